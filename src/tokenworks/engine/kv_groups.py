"""Layer groups of the KV cache: which layers share a block table, and what each keeps.

A model whose layers all attend to everything needs one block table per sequence. A model
with sliding windows (Gemma 2/3, Mistral) does not: a windowed layer never reads a key more
than `window` tokens back, so the blocks wholly behind the window can go back to the pool
while the global layers keep theirs. The layers are therefore split into groups of equal
size, each with its own block table (vLLM's hybrid allocator does the same):

- the layers of one kind (one window, or none) are cut into groups of `size` layers, where
  `size` is the smallest count of any kind; Gemma 3 270M (15 windowed, 3 global) gives six
  groups of 3: five windowed, one global;
- the pool holds `size` tensors a side, and tensor j serves layer j of every group: a block
  id names `size` layers' K/V for whichever group holds it, so all groups draw blocks from
  one free list and the pool is never split ahead of the workload;
- a windowed group's table keeps its place for every block position (`NULL` where a block
  was given back), so position p is still in entry p // block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.shapes import first_block_read

NULL = -1  # a block table entry whose block was given back (behind the window)


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None  # None: the group keeps every token's K/V


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    size: int  # layers per group: the pool's tensors a side
    # layer -> (its group, its tensor in the pool)
    where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = {
            layer: (g, j) for g, grp in enumerate(self.groups) for j, layer in enumerate(grp.layers)
        }
        object.__setattr__(self, "where", where)

    @classmethod
    def single(cls, n_layers: int) -> KVLayout:
        """Every layer in one group that keeps everything (windows, if any, only mask)."""
        return cls((KVGroup(tuple(range(n_layers)), None),), n_layers)

    @classmethod
    def for_spec(cls, spec, free_windows: bool = True) -> KVLayout:
        """The groups of a model (ModelSpec): one where no layer has a window or windows
        are only masks (free_windows False)."""
        n = spec.n_layers
        kinds: dict[int | None, list[int]] = {}
        for i in range(n):
            kinds.setdefault(spec.window(i), []).append(i)
        if not free_windows or list(kinds) == [None]:
            return cls.single(n)
        size = min(len(layers) for layers in kinds.values())
        groups = []
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[window]
            for j in range(0, len(layers), size):
                groups.append(KVGroup(tuple(layers[j : j + size]), window))
        return cls(tuple(groups), size)

    # ------------------------------------------------------------------ layers

    def group_of(self, layer: int) -> int:
        return self.where[layer][0]

    def slot_of(self, layer: int) -> int:
        """Which of the pool's tensors holds this layer's K/V."""
        return self.where[layer][1]

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    @property
    def n_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def frees(self) -> bool:
        """Does any group give blocks back as a sequence moves on?"""
        return any(g.window is not None for g in self.groups)

    # ------------------------------------------------------------------ counting

    def bytes_per_block(self, kv_bytes_per_token: int, block_size: int, layers=None) -> int:
        """Bytes one block id holds: `size` layers of block_size tokens (kv_bytes_per_token
        is the model's, over all its layers); or, for a pipeline stage holding only
        `layers`, the pool tensors those layers use."""
        used = self.size if layers is None else len(self.slots(layers))
        return kv_bytes_per_token * used * block_size // self.n_layers

    def slots(self, layers) -> set[int]:
        """The pool tensors (a side) these layers' K/V live in."""
        return {self.slot_of(i) for i in layers}

    first_needed = staticmethod(first_block_read)  # the first block a query reads

    def blocks_held(self, tokens: int, block_size: int, chunk: int = 1, first: int = 0) -> int:
        """The most blocks (all groups) a sequence holds at once on its way to `tokens`
        tokens: its first pass `first` tokens, then at most `chunk` a pass. A windowed group
        holds the window behind the chunk being written, and the chunk."""
        full = -(-tokens // block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += full
            else:
                span = g.window - 1 + min(chunk, tokens)  # oldest key read .. newest written
                peak = max(-(-first // block_size), -(-span // block_size) + 1)
                total += min(full, peak)
        return total

    def describe(self) -> str:
        if not self.frees:
            return "one block table"
        kinds = {}
        for g in self.groups:
            kinds[g.window] = kinds.get(g.window, 0) + 1
        parts = [
            f"{count} {'global' if w is None else f'{w}-token window'}"
            for w, count in kinds.items()
        ]
        return f"{len(self.groups)} groups of {self.size} layers ({', '.join(parts)})"
