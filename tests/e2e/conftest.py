"""End-to-end tests (helpers in :mod:`helpers.e2e`; the checkpoint fixtures ``model_dir`` and
``tokenizer`` are the root conftest's).

Fixtures every API module shares, each over the module's own ``deployment`` (any object with a
``base_url``: ``eaas serve``, a lone attention client):

* ``model_name``: the id the deployment serves (``GET /v1/models``);
* ``oai``: the official ``openai`` client on it, no retries, a read timeout of the module's
  ``OAI_TIMEOUT_S`` (default :data:`OAI_TIMEOUT_S`);
* ``parity_deployment``: the one ``eaas serve`` (2 expert servers, no redundancy) of the API
  modules ``test_api_parity.py``, ``test_api_logprobs.py`` and ``test_api_structured.py``,
  started once per worker (the three run on one worker: ``tests/conftest.py``), and the first two's ``prompt_ids`` (the
  tokenizer's ids of ``PARITY_PROMPT``) and ``ref`` (its 12 greedy reference tokens).
"""

from __future__ import annotations

import openai
import pytest
import torch

from eaas.runtime.models.reference import reference_generate

from helpers.api import PARITY_PROMPT
from helpers.e2e import served_model_name, start_serve

# The test process computes references next to many server/client processes on few cores: more
# than one intra-op thread only adds contention (measured: 4x slower reference_generate).
torch.set_num_threads(1)

#: seconds the ``oai`` client waits for one answer, unless the module sets ``OAI_TIMEOUT_S``
OAI_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_name(deployment):
    return served_model_name(deployment.base_url)


@pytest.fixture(scope="module")
def oai(request, deployment):
    timeout = getattr(request.module, "OAI_TIMEOUT_S", OAI_TIMEOUT_S)
    c = openai.OpenAI(
        base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )
    yield c
    c.close()


@pytest.fixture(scope="session")
def parity_deployment(tmp_path_factory):
    sp = start_serve(tmp_path_factory, "serve-parity", ["--expert-servers", "2", "--replicas", "1"])
    yield sp
    sp.stop(check=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PARITY_PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def ref(model_dir, prompt_ids):
    return reference_generate(model_dir, [prompt_ids], 12)[0]
