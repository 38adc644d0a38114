"""``python -m helix_kv.executor``: a Helix run of a Hugging Face checkpoint, greedy.

::

    python -m helix_kv.executor --model DIR --prompts IN.jsonl --output OUT.jsonl \\
        [--kv-tokens N] [--host-tier-tokens N] [--overlap] [--dtype D] [--device D]
    torchrun --nproc-per-node CP -m helix_kv.executor --model DIR ...   # one rank per process

``IN.jsonl`` has one ``{"id", "token_ids", "max_new_tokens"}`` object per line; ``OUT.jsonl``
gets one ``{"id", "token_ids"}`` per request (the generated tokens, in input order), written
by rank 0. Under ``torchrun`` the world is the CP group (NCCL on CUDA, gloo on the CPU), each
rank on ``cuda:LOCAL_RANK``; every rank loads the checkpoint and schedules identically. The
run prints the preemptions (recompute-pause), the suspensions (to the host tier) and the
tokens per second. Exit status 2 for bad input (a checkpoint, prompt file or option that
cannot be used; the message says which), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from helix_kv.errors import CheckpointError, HelixKVError, TraceError, UsageError
from helix_kv.executor.checkpoint import _is_int, read_config
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_rank

_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class PromptFile:
    """The requests of an ``IN.jsonl`` file, in file order."""

    ids: list[int]
    token_ids: dict[int, list[int]]
    max_new_tokens: dict[int, int]


def read_prompts(path: str | Path, vocab_size: int) -> PromptFile:
    """Parse ``IN.jsonl``; a :class:`~helix_kv.errors.TraceError` names the line at fault."""
    ids: list[int] = []
    tokens: dict[int, list[int]] = {}
    budgets: dict[int, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(path, f"cannot read: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TraceError(path, f"not JSON: {exc}", number) from exc
        if not isinstance(record, dict) or set(record) != {"id", "token_ids", "max_new_tokens"}:
            raise TraceError(
                path, 'each line is one {"id", "token_ids", "max_new_tokens"} object', number
            )
        rid, prompt, budget = record["id"], record["token_ids"], record["max_new_tokens"]
        if not _is_int(rid) or rid < 0:
            raise TraceError(path, f"id must be a non-negative integer, got {rid!r}", number)
        if rid in tokens:
            raise TraceError(path, f"id {rid} given twice", number)
        if not isinstance(prompt, list) or not prompt:
            raise TraceError(path, "token_ids must be a non-empty list", number)
        if not all(_is_int(t) and 0 <= t < vocab_size for t in prompt):
            raise TraceError(
                path, f"token_ids must be integers in [0, vocab_size = {vocab_size})", number
            )
        if not _is_int(budget) or budget < 1:
            raise TraceError(
                path, f"max_new_tokens must be a positive integer, got {budget!r}", number
            )
        ids.append(rid)
        tokens[rid] = prompt
        budgets[rid] = budget
    if not ids:
        raise TraceError(path, "no requests")
    return PromptFile(ids, tokens, budgets)


def build_parser() -> argparse.ArgumentParser:
    """The command line's arguments."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Greedy Helix decoding of a Hugging Face checkpoint through helix_kv.",
    )
    parser.add_argument(
        "--model", required=True, help="checkpoint directory (config.json + *.safetensors)"
    )
    parser.add_argument(
        "--prompts", required=True, help='IN.jsonl: {"id", "token_ids", "max_new_tokens"} per line'
    )
    parser.add_argument(
        "--output", required=True, help='OUT.jsonl: {"id", "token_ids"} per line (rank 0)'
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="the CP group's KV budget in tokens (default: every request at once)",
    )
    parser.add_argument(
        "--host-tier-tokens",
        type=int,
        default=0,
        help="host KV tier in tokens (suspend to host under pressure; default 0: none)",
    )
    parser.add_argument("--overlap", action="store_true", help="schedule one step ahead")
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="weights and activations (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available"
    )
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument(
        "--eos-token-id",
        default="auto",
        help="auto (config.json's; the first of a list), none, or an id",
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        help="n-gram drafts verified per request and step (0: off)",
    )
    parser.add_argument(
        "--random-weights",
        type=int,
        default=None,
        metavar="SEED",
        help="build the model of config.json with seeded random weights (no *.safetensors read)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs (default: on CUDA)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return _run(args, world)
    except (CheckpointError, TraceError, UsageError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


_PROG = "python -m helix_kv.executor"


def _UsageError(message: str) -> UsageError:
    return UsageError(message, prog=_PROG)


def _run(args: argparse.Namespace, world: int) -> int:
    for name in ("tokens_per_block", "max_batch_size", "max_num_tokens"):
        if getattr(args, name) < 1:
            raise _UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.host_tier_tokens < 0 or args.spec_tokens < 0:
        raise _UsageError("--host-tier-tokens and --spec-tokens must not be negative")
    model_config = read_config(args.model)
    prompts = read_prompts(args.prompts, model_config.vocab_size)
    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():  # before the run, not after it
        raise _UsageError(f"--output {args.output}: not a file in an existing directory")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda but no CUDA device is available")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if world > 1:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    tpb, cp = args.tokens_per_block, world
    superblock_tokens = tpb * cp
    total = sum(len(prompts.token_ids[r]) + prompts.max_new_tokens[r] for r in prompts.ids)
    kv_tokens = args.kv_tokens if args.kv_tokens is not None else total + superblock_tokens
    if kv_tokens < superblock_tokens:
        raise _UsageError(
            f"--kv-tokens {kv_tokens} is below one superblock ({superblock_tokens} tokens)"
        )
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device == "cuda"
    if graphs and device != "cuda":
        raise _UsageError("--cuda-graphs needs --device cuda")
    config = ExecutorConfig(
        cp_size=cp,
        tokens_per_block=tpb,
        kv_superblocks=-(-kv_tokens // superblock_tokens),
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        model=(
            str(args.model)
            if args.random_weights is None
            else dataclasses.replace(model_config, seed=args.random_weights)
        ),
        dtype=dtype,
        device=device,
        decode_kernel=device == "cuda",
        cuda_graphs=graphs,
        host_tier_pages=args.host_tier_tokens // superblock_tokens,
        overlap=args.overlap,
        eos_token_id=_eos(args.eos_token_id, Path(args.model), rank),
        num_speculative_tokens=args.spec_tokens,
    )
    try:
        result = run_rank(prompts.token_ids, prompts.max_new_tokens, config)
    except HelixKVError as exc:  # a request the budget can never hold, a config the core refuses
        raise _UsageError(str(exc)) from exc
    if rank == 0:
        lines = [json.dumps({"id": rid, "token_ids": result.outputs[rid]}) for rid in prompts.ids]
        try:
            output.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        except OSError as exc:
            raise _UsageError(f"--output {args.output}: {exc.strerror or exc}") from exc
        print(_summary(result, cp, len(prompts.ids)))
    return 0


def _eos(option: str, directory: Path, rank: int) -> int | None:
    if option == "none":
        return None
    if option != "auto":
        try:
            return int(option)
        except ValueError:
            raise _UsageError(
                f"--eos-token-id must be auto, none or an integer, got {option!r}"
            ) from None
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("eos_token_id")
    if isinstance(raw, list):
        if len(raw) > 1 and rank == 0:
            print(f"note: config.json lists EOS ids {raw}; requests end at the first, {raw[0]}")
        raw = raw[0] if raw else None
    return raw if _is_int(raw) else None


def _summary(result: RunResult, cp: int, requests: int) -> str:
    metrics = result.metrics
    generated = sum(len(tokens) for tokens in result.outputs.values())
    rate = generated / result.total_s if result.total_s else 0.0
    counts = ", ".join(
        f"{int(metrics.get(name, 0))} {name}"
        for name in ("steps", "preemptions", "suspensions", "resumes")
    )
    return (
        f"cp {cp}: {requests} requests, {generated} tokens generated in {result.total_s:.2f} s "
        f"({rate:,.0f} tokens/s; decode steps {result.decode_tokens_per_s:,.0f} tokens/s), "
        f"{counts}"
    )


__all__ = ["PromptFile", "build_parser", "main", "read_prompts"]
