"""The pure core of upstream pools: the balancing choice, passive ejection, the active
health state machine, retry eligibility, and state kept across reloads."""

import random
from collections import Counter

import pytest

from gateway.config.pool_model import Balance, HealthCheck, PassiveEjection
from gateway.testing import config_from_yaml
from gateway.upstream.balancing import Balancer, Outcome, TargetState, TargetStates, retry_allowed

# The chi-square statistic's critical value at p = 0.001 for 2 degrees of freedom: a
# correct balancer fails these tests once in a thousand runs, and a seeded one never.
CHI_SQUARE_2DF_P001 = 13.816

PASSIVE = PassiveEjection(eject_after=3, eject_for=30.0)
HEALTH = HealthCheck(path="/healthz", interval=5.0, timeout=1.0, unhealthy_after=3, healthy_after=2)


def states(n, passive=None, health=None):
    return [TargetState(passive, health) for _ in range(n)]


def picks(balancer, count, now=0.0):
    return [balancer.choose(now) for _ in range(count)]


def chi_square(observed: Counter, weights: list[int], total: int) -> float:
    return sum((observed[i] - total * w / sum(weights)) ** 2 / (total * w / sum(weights)) for i, w in enumerate(weights))


def test_smooth_round_robin_spreads_heavy_targets_as_nginx_does():
    # nginx's own example (ngx_http_upstream_round_robin.c): weights 5, 1, 1.
    balancer = Balancer(states(3), [5, 1, 1], Balance.ROUND_ROBIN)
    assert picks(balancer, 14) == [0, 0, 1, 0, 2, 0, 0] * 2


def test_smooth_round_robin_is_exact_in_every_cycle_of_the_weights():
    balancer = Balancer(states(3), [1, 2, 3], Balance.ROUND_ROBIN)
    for _ in range(100):
        assert Counter(picks(balancer, 6)) == {0: 1, 1: 2, 2: 3}


def test_equal_weights_take_turns():
    balancer = Balancer(states(3), [1, 1, 1], Balance.ROUND_ROBIN)
    assert picks(balancer, 6) == [0, 1, 2, 0, 1, 2]


def test_targets_out_of_rotation_or_already_tried_are_never_chosen():
    targets = states(3, PASSIVE)
    balancer = Balancer(targets, [1, 1, 1], Balance.ROUND_ROBIN)
    targets[1].healthy = False
    assert set(picks(balancer, 20)) == {0, 2}
    assert balancer.choose(0.0, tried=0b001) == 2
    assert balancer.choose(0.0, tried=0b101) is None
    targets[0].healthy = targets[2].healthy = False
    assert balancer.choose(0.0) is None


def test_least_requests_prefers_the_least_loaded_for_its_weight():
    targets = states(3)
    balancer = Balancer(targets, [1, 1, 2], Balance.LEAST_REQUESTS)
    targets[0].in_flight, targets[1].in_flight, targets[2].in_flight = 3, 1, 4  # loads 3, 1, 2
    assert picks(balancer, 5) == [1] * 5
    targets[1].in_flight = 5  # loads 3, 5, 2
    assert balancer.choose(0.0) == 2


def test_least_requests_follows_the_weights_while_all_are_idle():
    balancer = Balancer(states(3), [1, 2, 3], Balance.LEAST_REQUESTS)
    assert Counter(picks(balancer, 600)) == {0: 100, 1: 200, 2: 300}


def test_random_two_choices_follows_the_weights_while_all_are_idle():
    balancer = Balancer(states(3), [1, 2, 3], Balance.RANDOM_TWO_CHOICES, rng=random.Random(7))
    total = 6000
    observed = Counter(picks(balancer, total))
    assert chi_square(observed, [1, 2, 3], total) < CHI_SQUARE_2DF_P001, observed


def test_random_two_choices_takes_the_less_loaded_of_the_two_drawn():
    targets = states(2)
    balancer = Balancer(targets, [1, 1], Balance.RANDOM_TWO_CHOICES, rng=random.Random(1))
    targets[0].in_flight = 10
    # With two targets both are always drawn, so the idle one always wins.
    assert picks(balancer, 50) == [1] * 50


def test_three_targets_two_choices_never_picks_the_busiest():
    targets = states(3)
    balancer = Balancer(targets, [1, 1, 1], Balance.RANDOM_TWO_CHOICES, rng=random.Random(3))
    targets[2].in_flight = 10
    chosen = Counter(picks(balancer, 3000))
    assert chosen[2] == 0 and chosen[0] > 1000 and chosen[1] > 1000


def test_passive_ejection_after_consecutive_failures_for_eject_for():
    target = TargetState(PASSIVE, None)
    assert not target.answered(Outcome.CONNECT_FAILED, 1.0)
    assert not target.answered(Outcome.SERVER_ERROR, 1.0)
    assert target.answered(Outcome.TIMEOUT, 1.0)  # the third in a row
    assert not target.available(1.0) and not target.available(30.9)
    assert target.available(31.0)


def test_a_success_between_failures_starts_the_count_again():
    target = TargetState(PASSIVE, None)
    for _ in range(10):
        assert not target.answered(Outcome.FAILED, 1.0)
        assert not target.answered(Outcome.FAILED, 1.0)
        assert not target.answered(Outcome.ANSWERED, 1.0)
    assert target.available(1.0)


def test_failures_of_attempts_finishing_while_ejected_neither_extend_it_nor_count_later():
    target = TargetState(PASSIVE, None)
    for _ in range(3):
        target.answered(Outcome.CONNECT_FAILED, 0.0)
    for _ in range(5):
        assert not target.answered(Outcome.FAILED, 10.0)
    assert target.available(30.0)
    assert not target.answered(Outcome.FAILED, 30.0)  # back with a clean slate: one is not three
    assert target.available(30.0)


def test_without_passive_ejection_failures_never_eject():
    target = TargetState(None, None)
    for _ in range(100):
        assert not target.answered(Outcome.CONNECT_FAILED, 0.0)
    assert target.available(0.0)


def test_active_checks_take_a_target_out_after_unhealthy_after_and_back_after_healthy_after():
    target = TargetState(None, HEALTH)
    assert target.healthy  # in rotation until checks say otherwise
    assert [target.checked(False) for _ in range(3)] == [False, False, True]
    assert not target.available(0.0)
    assert [target.checked(True) for _ in range(2)] == [False, True]
    assert target.available(0.0)


def test_a_target_the_checks_see_recover_rejoins_before_its_ejection_ends():
    target = TargetState(PASSIVE, HEALTH)
    for _ in range(3):
        target.answered(Outcome.CONNECT_FAILED, 0.0)
        target.checked(False)
    for _ in range(5):
        target.checked(True)
    assert target.available(1.0)  # eject_for is 30 s


def test_passing_checks_alone_do_not_end_an_ejection():
    target = TargetState(PASSIVE, HEALTH)
    for _ in range(3):
        target.answered(Outcome.SERVER_ERROR, 0.0)
    for _ in range(5):
        assert not target.checked(True)
    assert not target.available(1.0)


def test_alternating_checks_never_flip_a_target():
    target = TargetState(None, HEALTH)
    for _ in range(20):
        assert not target.checked(False)
        assert not target.checked(False)
        assert not target.checked(True)
    assert target.healthy


@pytest.mark.parametrize("outcome", [o for o in Outcome if o is not Outcome.CONNECT_FAILED])
def test_only_a_connect_failure_is_retried(outcome):
    assert not retry_allowed(outcome, retries_used=0, retries=5, remaining=None)


def test_retries_are_bounded_by_their_count_and_the_time_left():
    connect = Outcome.CONNECT_FAILED
    assert retry_allowed(connect, retries_used=0, retries=2, remaining=None)
    assert retry_allowed(connect, retries_used=1, retries=2, remaining=0.5)
    assert not retry_allowed(connect, retries_used=2, retries=2, remaining=None)
    assert not retry_allowed(connect, retries_used=0, retries=2, remaining=0.0)
    assert not retry_allowed(connect, retries_used=0, retries=0, remaining=None)


POOLS_YAML = """
routes:
  - match: {{path: /a}}
    upstream:
      targets: [http://127.0.0.1:9001, http://127.0.0.1:9002]
      passive: {{eject_after: {eject_after}}}
  - match: {{path: /b}}
    upstream:
      targets: [http://127.0.0.1:9001]
      passive: {{eject_after: {eject_after}}}
"""


def test_target_state_is_shared_by_routes_and_kept_across_reloads_while_its_settings_stay():
    registry = TargetStates()
    first = registry.update(config_from_yaml(POOLS_YAML.format(eject_after=3)))
    assert set(first) == {"http://127.0.0.1:9001", "http://127.0.0.1:9002"}
    same = registry.update(config_from_yaml(POOLS_YAML.format(eject_after=3)))
    assert same["http://127.0.0.1:9001"] is first["http://127.0.0.1:9001"]
    changed = registry.update(config_from_yaml(POOLS_YAML.format(eject_after=4)))
    assert changed["http://127.0.0.1:9001"] is not first["http://127.0.0.1:9001"]
    assert changed["http://127.0.0.1:9001"].passive.eject_after == 4
    gone = registry.update(config_from_yaml("routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9001\n"))
    assert gone == {}
