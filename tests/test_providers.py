"""Choosing the execution provider."""

import pytest

from edgeinfer import Engine
from edgeinfer.sdk.errors import ProviderError
from edgeinfer.sdk.runtime import choose_provider, cuda_unusable_reason


def test_unknown_provider_is_refused(tiny_llama):
    with pytest.raises(ProviderError, match="unknown provider 'tpu': use 'auto', 'cpu' or 'cuda'"):
        Engine.load(tiny_llama[1], provider="tpu")


def test_auto_says_what_it_chose(tiny_llama):
    engine = Engine.load(tiny_llama[1])
    reason = cuda_unusable_reason()
    assert engine.provider == ("cuda" if reason is None else "cpu")
    if reason:
        assert engine.provider_reason == f"auto chose cpu: {reason}"


@pytest.mark.skipif(cuda_unusable_reason() is None, reason="CUDA is usable here")
def test_cuda_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(ProviderError, match="provider 'cuda' cannot run here: .*use provider 'cpu'"):
        choose_provider("cuda")
