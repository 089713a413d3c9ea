"""Runs the variants of a parametrized test together, for tests that mostly wait (a fault's
pace, a TTL): the first variant's test measures its whole group at once, concurrently, and
each variant's test then asserts on its own result. Each variant must have parts of its own
(servers, processes, keys), so that running beside the others changes nothing it asserts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Together(Generic[T]):
    def __init__(self, groups: Iterable[Sequence[str]]) -> None:
        self._group_of = {name: tuple(group) for group in groups for name in group}
        self._measured: dict[str, T] = {}  # variants measured, until their own test reads them

    def group_of(self, name: str) -> tuple[str, ...]:
        return self._group_of[name]

    async def result(self, name: str, measure: Callable[[tuple[str, ...]], Awaitable[Sequence[T]]]) -> T:
        """`name`'s result: `measure` runs its group now (returning a result per name, in the
        group's order), unless an earlier test of the group already did."""
        if name not in self._measured:
            group = self._group_of[name]
            self._measured.update(zip(group, await measure(group), strict=True))
        return self._measured.pop(name)
