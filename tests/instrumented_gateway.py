"""`python -m tests.instrumented_gateway run -c FILE`: the gateway exactly as
`python -m gateway run -c FILE` starts it, except that the Redis store loads the
logging build of its script (tests/replay_script.py).

The swap is one assignment before anything runs: `RedisStore` reads its script
through the module-level `redis_store.load_script` when it is built, and this
launcher replaces that function in this process only. Production code has no
hook, flag or file for it; the script's SHA is computed from the text, so the
store sends and caches the instrumented text like any other.
"""

from gateway.redis import scripts as redis_store
from tests.replay_script import instrumented

_shipped = redis_store.load_script


def _load_instrumented(name: str = redis_store.SCRIPT_NAME) -> str:
    text = _shipped(name)
    return instrumented(text) if name == redis_store.SCRIPT_NAME else text


redis_store.load_script = _load_instrumented

from gateway.cli import main  # noqa: E402  (after the swap, as `python -m gateway` would import it)

raise SystemExit(main())
