"""The keys and values of every running sequence, one slot each: per layer a tensor [slots, kv_heads, capacity,
head_dim], a sequence's position p at column p of its slot.

A sequence never moves while it runs but when another one leaves: the running sequences hold slots 0..n-1, and the
one in the last slot takes the place of one that ended (its columns copied, one row), so a step's attention reads
the running slots as one view, never a copy of the cache. New tokens are written in place (one indexed write per
layer), where transformers' DynamicCache concatenates the whole cache at every token. The tensors grow (twice the
slots or columns, copied once) when a sequence needs more than they hold, and are allocated at a layer's first
write, in the dtype and on the device of its keys.
"""

from __future__ import annotations

import torch


class SlotCache:
    def __init__(self, slots: int = 8, capacity: int = 256):
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def bytes_per_position(self) -> int:
        """What one position of one slot costs over every layer (0 before the first write)."""
        return sum(k[0, :, 0].numel() * k.element_size() * 2 for k in self.keys if k is not None)

    def reserve(self, slots: int, capacity: int) -> None:
        """Room for `slots` sequences of up to `capacity` positions each (doubling what is short)."""
        grown_slots, grown_capacity = self.slots, self.capacity
        while grown_slots < slots:
            grown_slots *= 2
        while grown_capacity < capacity:
            grown_capacity *= 2
        if (grown_slots, grown_capacity) == (self.slots, self.capacity):
            return
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                if old is not None:
                    new = old.new_zeros(grown_slots, old.shape[1], grown_capacity, old.shape[3])
                    new[:old.shape[0], :, :old.shape[2]] = old
                    store[layer] = new
        self.slots, self.capacity = grown_slots, grown_capacity

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's keys and values [tokens, kv_heads, head_dim] at its slot and position; the layer's whole
        tensors back."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is None:
            shape = (self.slots, keys.shape[1], self.capacity, keys.shape[2])
            self.keys[layer] = keys.new_zeros(shape)
            self.values[layer] = values.new_zeros(shape)
        self.keys[layer][slots, :, positions] = keys.to(self.keys[layer].dtype)
        self.values[layer][slots, :, positions] = values.to(self.values[layer].dtype)
        return self.keys[layer], self.values[layer]

    def move(self, source: int, target: int, length: int) -> None:
        """Slot `source`'s first `length` positions into slot `target` (a sequence changing slots)."""
        for store in (self.keys, self.values):
            for tensor in store:
                if tensor is not None:
                    tensor[target, :, :length] = tensor[source, :, :length]

    def copy_prefix(self, source: int, targets: list[int], length: int) -> None:
        """Slot `source`'s first `length` positions into each of `targets` (answers sharing one prompt)."""
        if not targets:
            return
        index = torch.tensor(targets, device=self.keys[0].device if self.keys else "cpu")
        for store in (self.keys, self.values):
            for tensor in store:
                if tensor is not None:
                    tensor[index, :, :length] = tensor[source, :, :length].unsqueeze(0)

    def clear(self) -> None:
        """Every tensor dropped (after a failed step: what it wrote is not trusted)."""
        self.keys, self.values = [], []
