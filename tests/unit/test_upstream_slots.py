"""UpstreamSlots, the bounded wait for an upstream connection, on its own: slots are taken
without waiting while free, handed to waiters in order, and never lost to a wait that
timed out or was cancelled."""

import asyncio

import pytest

from gateway.upstream.slots import UpstreamSlots


async def test_free_slots_are_taken_at_once_and_then_none_is():
    slots = UpstreamSlots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take()
    slots.give_back()
    assert slots.try_take()


async def test_a_wait_ends_false_at_its_timeout_and_leaves_the_count_alone():
    slots = UpstreamSlots(1)
    assert slots.try_take()
    assert await slots.take(0.05) is False
    slots.give_back()
    assert slots.try_take()  # the timed-out waiter did not keep the slot
    assert not slots.try_take()


async def test_a_slot_given_back_goes_to_the_first_waiter_in_line():
    slots = UpstreamSlots(1)
    assert slots.try_take()
    first = asyncio.ensure_future(slots.take(5))
    second = asyncio.ensure_future(slots.take(5))
    await asyncio.sleep(0)  # both in line
    assert not slots.try_take()  # a newcomer does not jump the line
    slots.give_back()
    assert await first is True
    assert not second.done()
    slots.give_back()
    assert await second is True
    slots.give_back()
    assert slots.try_take()


async def test_a_cancelled_waiter_that_was_handed_a_slot_gives_it_back():
    slots = UpstreamSlots(1)
    assert slots.try_take()
    waiting = asyncio.ensure_future(slots.take(5))
    await asyncio.sleep(0)
    slots.give_back()  # handed to `waiting`, which is cancelled before it runs
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert slots.try_take()
