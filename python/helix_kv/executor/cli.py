"""``python -m helix_kv.executor``: a Helix run of a Hugging Face checkpoint, greedy.

::

    python -m helix_kv.executor --model DIR --prompts IN.jsonl --output OUT.jsonl \\
        [--kv-tokens N] [--host-tier-tokens N] [--overlap] [--dtype D] [--device D] \\
        [--prefix-caching] [--spec-tokens K] [--json]
    torchrun --nproc-per-node CP -m helix_kv.executor --model DIR ...   # one rank per process

``IN.jsonl`` has one ``{"id", "token_ids", "max_new_tokens"}`` object per line; ``OUT.jsonl``
gets one ``{"id", "token_ids"}`` per request (the generated tokens, in input order), written
by rank 0. Under ``torchrun`` the world is the CP group (NCCL on CUDA, gloo on the CPU), each
rank on ``cuda:LOCAL_RANK``; every rank loads the checkpoint and schedules identically. The
run prints one summary line on stdout (rank 0): the steps, preemptions (recompute-pause),
suspensions and resumes (the host tier), tokens per second, and with ``--prefix-caching``
the prefix cache's hits, with ``--spec-tokens`` the drafts accepted; ``--json`` prints it as
one JSON object (:func:`run_summary`) instead. Exit status 2 for bad input (a checkpoint,
prompt file or option that cannot be used; the message says which), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from helix_kv.errors import CheckpointError, HelixKVError, TraceError, UsageError
from helix_kv.executor.checkpoint import _is_int, eos_token_ids, read_config
from helix_kv.executor.model import ModelConfig
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
        help="auto (the checkpoint's, as transformers' generate takes them: "
        "generation_config.json, else config.json; any of a list ends a request), none, "
        "or ids separated by commas",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="the scheduler's prefix cache: prompts reuse the KV of cached prefixes",
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
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object (docs/executor.md) instead of a line",
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
    eos = _eos(args.eos_token_id, Path(args.model))
    if world > 1:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    config = _executor_config(args, model_config, prompts, world, device, eos)
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
        summary = run_summary(result, config, len(prompts.ids))
        print(json.dumps(summary) if args.json else _summary_line(summary))
    return 0


def _executor_config(
    args: argparse.Namespace,
    model_config: ModelConfig,
    prompts: PromptFile,
    cp: int,
    device: str,
    eos: tuple[int, ...],
) -> ExecutorConfig:
    """The run's :class:`ExecutorConfig` from the options (checked here)."""
    tpb = args.tokens_per_block
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
    return ExecutorConfig(
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
        dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        device=device,
        decode_kernel=device == "cuda",
        cuda_graphs=graphs,
        host_tier_pages=args.host_tier_tokens // superblock_tokens,
        overlap=args.overlap,
        eos_token_id=eos or None,
        num_speculative_tokens=args.spec_tokens,
        scheduler_options={"enable_prefix_caching": True} if args.prefix_caching else {},
    )


def _eos(option: str, directory: Path) -> tuple[int, ...]:
    """``--eos-token-id``: the ids that end a request (``()``: none)."""
    if option == "none":
        return ()
    if option == "auto":
        return eos_token_ids(directory)
    try:
        ids = tuple(int(part) for part in option.split(","))
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0:
        raise _UsageError(
            "--eos-token-id must be auto, none or non-negative integers separated by commas, "
            f"got {option!r}"
        )
    return ids


def run_summary(result: RunResult, config: ExecutorConfig, requests: int) -> dict[str, Any]:
    """What the command reports of a run (``--json`` prints it; docs/executor.md)."""
    metrics = result.metrics
    generated = sum(len(tokens) for tokens in result.outputs.values())
    prefix = bool(config.scheduler_options.get("enable_prefix_caching", False))
    queries = int(metrics.get("prefix_cache_queries", 0))
    hits = int(metrics.get("prefix_cache_hits", 0))
    drafted = int(metrics.get("spec_decode_num_draft_tokens", 0))
    return {
        "cp_size": config.cp_size,
        "requests": requests,
        "generated_tokens": generated,
        "total_s": result.total_s,
        "tokens_per_s": generated / result.total_s if result.total_s else 0.0,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        **{name: int(metrics.get(name, 0)) for name in _COUNTS},
        "prefix_cache": {
            "enabled": prefix,
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "recompute_queries": int(metrics.get("prefix_cache_recompute_queries", 0)),
            "recompute_hits": int(metrics.get("prefix_cache_recompute_hits", 0)),
            "same_step_hits": int(metrics.get("prefix_cache_same_step_hits", 0)),
            "evictions": int(metrics.get("prefix_cache_evictions", 0)),
        },
        "spec_decode": {
            "num_speculative_tokens": config.num_speculative_tokens,
            "drafted": drafted,
            "accepted": int(metrics.get("spec_decode_num_accepted_tokens", 0)),
            "acceptance_rate": result.draft_acceptance_rate,
            "draft_steps": result.draft_steps,
        },
    }


_COUNTS = ("steps", "preemptions", "suspensions", "resumes")


def _summary_line(summary: Mapping[str, Any]) -> str:
    counts = ", ".join(f"{summary[name]} {name}" for name in _COUNTS)
    line = (
        f"cp {summary['cp_size']}: {summary['requests']} requests, "
        f"{summary['generated_tokens']} tokens generated in {summary['total_s']:.2f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s; decode steps "
        f"{summary['decode_tokens_per_s']:,.0f} tokens/s), {counts}"
    )
    prefix = summary["prefix_cache"]
    if prefix["enabled"]:
        line += (
            f"; prefix cache {prefix['hits']} of {prefix['queries']} prompt tokens hit "
            f"({prefix['hit_rate']:.1%}), {prefix['recompute_hits']} of "
            f"{prefix['recompute_queries']} re-prefill tokens hit, "
            f"{prefix['evictions']} evictions"
        )
    spec = summary["spec_decode"]
    if spec["num_speculative_tokens"]:
        line += (
            f"; drafts {spec['accepted']} of {spec['drafted']} accepted "
            f"({spec['acceptance_rate']:.1%}) in {spec['draft_steps']} steps"
        )
    return line


__all__ = ["PromptFile", "build_parser", "main", "read_prompts", "run_summary"]
