"""ParamsCache: a params dict seen before gives the SamplingParams built for it, and
nothing that fails validation gets past it by resembling a valid dict."""

from __future__ import annotations

import pytest

from replica.sampling_params import ParamsCache, SamplingParams


class CountingBuild:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data: dict) -> SamplingParams:
        self.calls += 1
        return SamplingParams.from_dict(data)


def test_a_repeated_dict_is_built_once() -> None:
    build = CountingBuild()
    cache = ParamsCache(build)
    first = cache.get({"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]})
    again = cache.get({"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]})  # a new dict
    assert again is first and build.calls == 1
    assert first == SamplingParams(max_tokens=8, temperature=0.0, stop=("\n",))
    other = cache.get({"max_tokens": 9, "temperature": 0.0, "stop": ["\n"]})
    assert other.max_tokens == 9 and build.calls == 2


@pytest.mark.parametrize(
    "valid, invalid, field",
    [
        ({"max_tokens": 16}, {"max_tokens": 16.0}, "max_tokens"),
        ({"ignore_eos": True}, {"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [1]}, {"stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
def test_equal_values_of_another_type_are_validated_anew(valid, invalid, field) -> None:
    # 16 == 16.0 and 1 == True: a key on values alone would hand back the valid params.
    cache = ParamsCache(CountingBuild())
    cache.get(valid)
    with pytest.raises(ValueError, match=field):
        cache.get(invalid)


def test_a_dict_that_fails_is_never_cached() -> None:
    build = CountingBuild()
    cache = ParamsCache(build)
    for _ in range(2):
        with pytest.raises(ValueError, match="temperature"):
            cache.get({"temperature": -1.0})
    assert build.calls == 2


def test_long_lists_and_odd_values_are_built_every_time() -> None:
    build = CountingBuild()
    cache = ParamsCache(build)
    long_stop = {"stop_token_ids": list(range(1000, 1000 + ParamsCache.MAX_KEY_BYTES // 2))}
    cache.get(long_stop)
    cache.get(long_stop)
    assert build.calls == 2
    with pytest.raises(ValueError, match="unknown sampling field"):
        cache.get({"unhashable": {1, 2}})  # a set: no key; build names the field
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="stop_token_ids"):
        cache.get({"stop_token_ids": deep})  # past the recursion limit: build decides
    with pytest.raises(ValueError, match="must be an object"):
        cache.get(["max_tokens", 8])
    with pytest.raises(ValueError, match="seed"):
        cache.get({"seed": 2**70})  # past msgpack's integers
    assert build.calls == 6


def test_the_cache_is_bounded() -> None:
    build = CountingBuild()
    cache = ParamsCache(build, max_entries=2)
    for max_tokens in (1, 2, 3, 1):
        cache.get({"max_tokens": max_tokens})
    assert build.calls == 4  # the third setting started the cache over
    cache.get({"max_tokens": 1})
    assert build.calls == 4
