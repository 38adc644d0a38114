"""Per-rank paged KV pool and the device tensors of one step.

The pool holds ``[layers, num_pages * tokens_per_block, kv_heads, head_dim]`` key and value
tensors, indexed by physical page id (superblock id == page id on every rank). A
:class:`StepBatch` is the device form of a :class:`~helix_kv.executor.step_plan.StepPlan`: every
host index array is packed into one (pinned, on CUDA) buffer and copied asynchronously; keys
are then gathered a whole page at a time through the block table, and their global positions
come from a per-rank table cached on the device, so building a step costs a handful of kernels
whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helix_kv.executor.attention import PAD_KEY_POSITION, PAD_QUERY_POSITION
from helix_kv.executor.placement import RankPlacement
from helix_kv.executor.staging import HostToDeviceStager
from helix_kv.executor.step_plan import StepPlan


@dataclass(frozen=True)
class AttentionGroup:
    """A contiguous run of entries attended together as one padded batch.

    Decode entries (one query each) and context chunks form separate groups, so a long chunk
    never pads every decode row to its length.

    Attributes:
        query_index: ``[entries, q_len]`` flat token row of each query (0 for padding).
        query_positions: ``[entries, q_len]`` global positions, ``-1`` for padding.
        pages: ``[entries, width]`` the requests' page ids (the block table cut to the widest
            local length, ``-1`` padding replaced by page 0, which the mask hides). Local key
            ``j`` sits in slot ``pages[j // tpb] * tpb + j % tpb``.
        key_positions: ``[entries, width * tpb]`` global position of local key ``j``,
            ``(j // tpb) * tpb * cp_size + cp_rank * tpb + j % tpb``; int64 max at and beyond the
            request's local length.
        unpad_index: rows of the flattened ``[entries * q_len]`` output that are real tokens,
            in flat token order; ``None`` when there is no padding.
    """

    query_index: torch.Tensor
    query_positions: torch.Tensor
    pages: torch.Tensor
    key_positions: torch.Tensor
    unpad_index: torch.Tensor | None


@dataclass(frozen=True)
class StepBatch:
    """Device tensors of one step on one rank (all int64 on the pool's device).

    ``block_table``, ``slot_mapping``, ``local_lens`` and ``past_seen_lens`` are the step's
    rows in entry order (generation entries, then context chunks). ``write_token_index`` /
    ``write_slots`` are the tokens this rank owns and where their KV goes (the ``>= 0`` part
    of ``slot_mapping``, selected on the host so the write never syncs).
    """

    plan: StepPlan
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    write_token_index: torch.Tensor
    write_slots: torch.Tensor
    block_table: torch.Tensor
    local_lens: torch.Tensor
    past_seen_lens: torch.Tensor
    sample_index: torch.Tensor
    groups: tuple[AttentionGroup, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens run in the step."""
        return self.plan.num_tokens


# The StepBatch fields staged from the plan's step-wide arrays, in staging order.
_STAGED_FIELDS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "write_token_index",
    "write_slots",
    "block_table",
    "local_lens",
    "past_seen_lens",
    "sample_index",
)


class KVPool:
    """One rank's paged KV cache.

    Args:
        num_layers, num_kv_heads, head_dim: model geometry.
        placement: this rank's Helix placement (cp_size, tokens_per_block, cp_rank).
        capacity_superblocks: ledger capacity; the pool holds one page per superblock.
        dtype, device: storage of the cache tensors.
        latent_dim: ``None`` for separate keys and values; else the pool stores keys only
            (multi-head latent attention: one latent plus its RoPE part per token, one head)
            and :attr:`value_cache` is the view of each key's first ``latent_dim`` elements.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        placement: RankPlacement,
        capacity_superblocks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        latent_dim: int | None = None,
    ) -> None:
        if capacity_superblocks < 1:
            raise ValueError("a KV pool needs at least one superblock")
        if latent_dim is not None and not 0 < latent_dim <= head_dim:
            raise ValueError(f"latent_dim {latent_dim} must be in [1, head_dim = {head_dim}]")
        #: Elements of a cached value that are a key's first ones (MLA), or ``None``.
        self.latent_dim = latent_dim
        self.placement = placement
        self.num_pages = capacity_superblocks
        self.device = torch.device(device)
        slots = capacity_superblocks * placement.tokens_per_block
        shape = (num_layers, slots, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        #: ``[layers, slots, kv_heads, value_dim]``: its own tensor, or (``latent_dim``) a
        #: view of the keys (nothing is stored twice).
        self.value_cache = (
            torch.zeros(shape, dtype=dtype, device=self.device)
            if latent_dim is None
            else self.key_cache[..., :latent_dim]
        )
        self._stager = HostToDeviceStager(self.device)
        self._local_index = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._local_positions = torch.zeros(0, dtype=torch.int64, device=self.device)

    @staticmethod
    def superblocks_for_bytes(
        byte_budget: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        kv_factor: int = 2,
    ) -> int:
        """Whole pages (= superblocks) one rank's KV byte budget holds (before the MIN sync);
        ``kv_factor``: 2 for keys and values, 1 for keys only (a latent pool)."""
        element = torch.empty((), dtype=dtype).element_size()
        page_bytes = kv_factor * num_layers * tokens_per_block * num_kv_heads * head_dim * element
        return byte_budget // page_bytes

    @property
    def kv_factor(self) -> int:
        """Cache tensors stored per head: 2 (keys and values) or 1 (keys only, latent)."""
        return 2 if self.latent_dim is None else 1

    @property
    def num_slots(self) -> int:
        """Token slots per layer on this rank."""
        return int(self.key_cache.shape[1])

    def prepare(self, plan: StepPlan) -> StepBatch:
        """Stage ``plan`` on the device: one async copy, then the key masks on the device."""
        if plan.placement != self.placement:
            raise ValueError(f"plan placement {plan.placement} != pool {self.placement}")
        owned = np.flatnonzero(plan.slot_mapping >= 0)
        group_bounds = _group_bounds(plan)
        host_groups = [_host_group(plan, start, end) for start, end in group_bounds]
        # The step-wide arrays, in the order of _STAGED_FIELDS.
        host_arrays: list[np.ndarray] = [
            plan.token_ids,
            plan.positions(),
            plan.slot_mapping,
            owned,
            plan.slot_mapping[owned],
            plan.block_table,
            plan.local_lens,
            plan.past_seen_lens,
            plan.sample_index,
        ]
        for group in host_groups:
            host_arrays.extend(group.arrays)
        staged = self._stager.stage(host_arrays)
        fixed = dict(zip(_STAGED_FIELDS, staged))
        local_lens = fixed["local_lens"]
        groups = []
        base = len(_STAGED_FIELDS)
        for host, (start, end) in zip(host_groups, group_bounds):
            pages, query_index, query_positions, *unpad = staged[base : base + len(host.arrays)]
            base += len(host.arrays)
            key_positions = self._key_positions(local_lens[start:end], host.width)
            groups.append(
                AttentionGroup(
                    query_index, query_positions, pages, key_positions, unpad[0] if unpad else None
                )
            )
        return StepBatch(plan=plan, groups=tuple(groups), **fixed)

    def _key_positions(self, local_lens: torch.Tensor, width: int) -> torch.Tensor:
        """``[entries, width * tpb]`` global positions of local keys, padding int64 max."""
        keys = width * self.placement.tokens_per_block
        if self._local_index.numel() < keys:
            grown = max(keys, 2 * self._local_index.numel())
            local = np.arange(grown, dtype=np.int64)
            self._local_index = torch.from_numpy(local).to(self.device)
            self._local_positions = torch.from_numpy(self.placement.global_positions(local)).to(
                self.device
            )
        visible = self._local_index[:keys] < local_lens[:, None]
        return torch.where(visible, self._local_positions[:keys], PAD_KEY_POSITION)

    def write(
        self, layer: int, batch: StepBatch, key: torch.Tensor, value: torch.Tensor | None
    ) -> None:
        """Store the KV of the step's tokens that this rank owns (``slot_mapping >= 0``).

        ``key`` / ``value``: ``[tokens, kv_heads, head_dim]`` for every token of the step;
        ``value`` ``None`` (and only then) for a latent pool.
        """
        if (value is None) != (self.latent_dim is not None):
            raise ValueError("a latent pool takes keys only; a key-value pool takes both")
        index = batch.write_token_index
        self.key_cache[layer].index_copy_(0, batch.write_slots, key[index].to(self.key_cache.dtype))
        if value is None:
            return
        self.value_cache[layer].index_copy_(
            0, batch.write_slots, value[index].to(self.value_cache.dtype)
        )

    def gather(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's keys and values of a group's requests, whole pages at a time:
        ``[entries, width * tpb, kv_heads, head_dim]`` (local key ``j`` at index ``j``)."""
        entries, width = group.pages.shape
        tpb = self.placement.tokens_per_block
        paged_shape = (self.num_pages, tpb, *self.key_cache.shape[2:])
        flat_shape = (entries, width * tpb, *self.key_cache.shape[2:])
        keys = self.key_cache[layer].view(paged_shape)[group.pages].view(flat_shape)
        if self.latent_dim is not None:
            return keys, keys[..., : self.latent_dim]
        values = self.value_cache[layer].view(paged_shape)[group.pages].view(flat_shape)
        return keys, values

    def read_tokens(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at explicit slots (for tests and debugging)."""
        return self.key_cache[layer][slots], self.value_cache[layer][slots]


@dataclass(frozen=True)
class _HostGroup:
    arrays: list[np.ndarray]  # pages, query_index, query_positions[, unpad_index]
    width: int  # pages per request covering the widest local length


def _group_bounds(plan: StepPlan) -> list[tuple[int, int]]:
    bounds = [(0, plan.num_generation), (plan.num_generation, plan.num_entries)]
    return [(start, end) for start, end in bounds if end > start]


def _host_group(plan: StepPlan, start: int, end: int) -> _HostGroup:
    counts = plan.counts[start:end]
    offsets = plan.token_offsets[start:end]
    q_len = int(counts.max())
    column = np.arange(q_len, dtype=np.int64)
    valid = column < counts[:, None]
    query_index = np.where(valid, offsets[:, None] + column, 0)
    query_positions = np.where(valid, plan.starts[start:end, None] + column, PAD_QUERY_POSITION)
    tpb = plan.placement.tokens_per_block
    width = max(1, -(-int(plan.local_lens[start:end].max()) // tpb))
    table = plan.block_table
    if table.ndim != 2 or table.shape[1] < width:
        raise ValueError(
            f"block table of shape {table.shape} cannot hold {width} pages of {tpb} local tokens"
        )
    pages = np.maximum(table[start:end, :width], 0)  # -1 padding -> page 0, masked
    arrays = [pages, query_index, query_positions]
    if not valid.all():
        arrays.append(np.flatnonzero(valid.ravel()))
    return _HostGroup(arrays, width)
