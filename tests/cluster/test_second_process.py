"""A Client in a second process, on the local Ray this module starts, as the README says.

Ray 2.60 turns token authentication on for a new local cluster (its token in
~/.ray/auth_token). A process that joins it by an explicit address (an argument or
RAY_ADDRESS) does not send the token unless RAY_AUTH_MODE=token is set: without it,
ray.init retries "InvalidAuthToken" until it gives up (about a minute here), which is
the failure a user meets. address="auto" turns token mode on by itself when a token
file exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench.cluster import fake_engine
from cluster import ClusterConfig, build_app

APP_NAME = "kvfleet-second"
SECOND_PROCESS = """
import json, sys
import ray
from cluster import Client
from replica.sampling_params import SamplingParams

ray.init(address=sys.argv[1], log_to_driver=False)
client = Client(sys.argv[2])
done = client.generate([1, 2, 3], SamplingParams(max_tokens=5))
print(json.dumps({"tokens": done.token_ids, "finish": done.finish_reason,
                  "replicas": len(client.stats())}))
"""


@pytest.fixture(scope="module")
def gcs_address(serve_base_url: str) -> Iterator[str]:
    import ray
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny", num_replicas=1, device="cpu", http=False, app_name=APP_NAME
    )
    serve.run(build_app(config, engine_factory=fake_engine), name=APP_NAME, route_prefix=None)
    yield ray.get_runtime_context().gcs_address
    serve.delete(APP_NAME)


def test_client_in_a_second_process_with_the_token(gcs_address: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "token"  # the README's recipe: the token comes from its file
    result = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, gcs_address, APP_NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(answer["tokens"]) == 5 and answer["finish"] == "length"
    assert answer["replicas"] == 1
