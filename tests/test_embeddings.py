"""Embedding exports (`edgeinfer export --task embedding`, export/embedding.py, sdk/embedder.py):
tiny random-weight causal LMs with a sentence-transformers config written in the test, checked
against transformers' hidden states pooled as sentence-transformers pools them."""

from __future__ import annotations

import base64
import json
import signal

import numpy as np
import openai
import pytest

from conftest import build_llama
from test_serve import start

from edgeinfer import Embedder, Engine
from edgeinfer.sdk.errors import ContextLengthError, ExportError, SettingsError

TEXTS = ["The capital of France is Paris.", "Hi", "Edge boxes run small language models close to their users, every day."]


def sentence_transformers_config(folder, pooling: str, normalize: bool) -> None:
    """modules.json and the Pooling module's config, as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {
        "pooling_mode_lasttoken": pooling == "last",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))


def reference(folder, texts, pooling: str, normalize: bool) -> np.ndarray:
    """transformers' base model, each text alone, pooled in torch as sentence-transformers does."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    vectors = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            vector = hidden[-1] if pooling == "last" else hidden.mean(0)
            vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(vectors).numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def embedding_models(tmp_path_factory):
    """{(pooling, normalize): (HF folder, export folder)}: last-token normalized (with Matryoshka
    widths 16 and 32), and mean pooling without normalization."""
    from edgeinfer.export import ExportOptions, export_model

    root, made = tmp_path_factory.mktemp("embedding"), {}
    for seed, (pooling, normalize, widths) in enumerate([("last", True, (16, 32)), ("mean", False, ())]):
        hf = root / f"hf-{pooling}"
        build_llama(hf, seed=seed)
        sentence_transformers_config(hf, pooling, normalize)
        export_model(str(hf), root / f"export-{pooling}", ExportOptions(task="embedding", matryoshka=widths))
        made[(pooling, normalize)] = hf, root / f"export-{pooling}"
    return made


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", False)])
def test_vectors_equal_transformers_pooled_as_the_sentence_transformers_config_says(embedding_models, pooling, normalize):
    hf, export = embedding_models[(pooling, normalize)]
    embedder = Engine.load(export, provider="cpu")
    assert isinstance(embedder, Embedder) and (embedder.pooling, embedder.normalize) == (pooling, normalize)
    expected = reference(hf, TEXTS, pooling, normalize)
    together = embedder.embed(TEXTS)
    assert cosines(together.vectors, expected).min() >= 0.9999
    np.testing.assert_allclose(together.vectors, expected, atol=1e-4)
    assert np.allclose(np.linalg.norm(together.vectors, axis=1), 1) == normalize
    alone = np.stack([embedder.embed(text).vectors[0] for text in TEXTS])
    np.testing.assert_allclose(together.vectors, alone, atol=1e-5)  # a text's vector does not depend on its batch
    assert together.token_counts == [len(embedder.tokenizer.encode(t)) for t in TEXTS]
    manifest = embedder.manifest
    assert manifest.task == "embedding" and manifest.embedding["from"] == "sentence-transformers config"
    assert manifest.validation["cosine_min"] >= 0.9999 and manifest.graph.outputs == ["last_hidden_state"]


def test_batches_of_many_texts_keep_their_order(embedding_models):
    _, export = embedding_models[("last", True)]
    embedder = Engine.load(export, provider="cpu", max_batch=3)
    texts = [TEXTS[i % 3] + " " * (i % 2) + str(i) for i in range(10)]
    vectors = embedder.embed(texts).vectors
    for i, text in enumerate(texts):
        np.testing.assert_allclose(vectors[i], embedder.embed(text).vectors[0], atol=1e-5)


def test_long_texts_are_refused_or_truncated_as_asked(embedding_models):
    _, export = embedding_models[("last", True)]
    embedder = Engine.load(export, provider="cpu")
    long = list(range(3, 303))  # 300 token ids, past the 256-token context
    with pytest.raises(ContextLengthError, match="an input has 300 tokens but the model's context is 256"):
        embedder.embed([long])
    cut = embedder.embed([long], truncate=True)
    assert cut.token_counts == [256]
    np.testing.assert_allclose(cut.vectors[0], embedder.embed([long[:256]]).vectors[0], atol=1e-6)


def test_dimensions_only_for_a_matryoshka_model(embedding_models):
    _, matryoshka = embedding_models[("last", True)]
    _, plain = embedding_models[("mean", False)]
    full = Engine.load(matryoshka, provider="cpu").embed(TEXTS[0]).vectors[0]
    short = Engine.load(matryoshka, provider="cpu").embed(TEXTS[0], dimensions=16).vectors[0]
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)  # the first 16, normalized again
    with pytest.raises(SettingsError, match="it is not Matryoshka-trained"):
        Engine.load(plain, provider="cpu").embed(TEXTS[0], dimensions=16)
    with pytest.raises(SettingsError, match="dimensions must be an integer from 1 to 64"):
        Engine.load(matryoshka, provider="cpu").embed(TEXTS[0], dimensions=65)
    with pytest.raises(SettingsError, match="dimensions 17 is not a width this model was trained to give: use one of 16, 32, 64"):
        Engine.load(matryoshka, provider="cpu").embed(TEXTS[0], dimensions=17)
    assert Engine.load(matryoshka, provider="cpu").embed(TEXTS[0], dimensions=64).vectors.shape == (1, 64)


def test_generation_and_embedding_refuse_each_others_calls(embedding_models, tiny_llama):
    _, export = embedding_models[("last", True)]
    with pytest.raises(SettingsError, match="this model embeds text"):
        Engine.load(export, provider="cpu").generate("Hi")
    with pytest.raises(SettingsError, match="this export generates text; embeddings need"):
        Engine.load(tiny_llama[1], provider="cpu").embed("Hi")


def test_export_options_that_do_not_apply_to_embeddings_are_refused(tmp_path):
    from edgeinfer.export import ExportOptions, Quantization

    with pytest.raises(ExportError, match="--task embedding exports fp32 hidden states for now: leave out --quantize"):
        ExportOptions(task="embedding", quantization=Quantization("int4"))
    with pytest.raises(ExportError, match="add --task embedding"):
        ExportOptions(pooling="mean")
    from edgeinfer.export.embedding import pooling_config

    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ExportError, match="uses pooling_mode_cls_token, which edgeinfer does not compute"):
        pooling_config(tmp_path, None)
    assert pooling_config(tmp_path, "mean")["pooling"] == "mean"


def test_the_server_answers_openai_embeddings_requests(embedding_models, tiny_llama):
    _, export = embedding_models[("last", True)]
    embedder = Engine.load(export, provider="cpu")
    process, url = start(export, "--provider", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model=export.name, input=TEXTS, encoding_format="float")
        assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == export.name
        expected = embedder.embed(TEXTS)
        np.testing.assert_allclose(np.array([d.embedding for d in reply.data]), expected.vectors, atol=1e-6)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected.prompt_tokens
        packed = client.embeddings.with_raw_response.create(model=export.name, input=TEXTS[0], encoding_format="base64")
        encoded = json.loads(packed.text)["data"][0]["embedding"]
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), expected.vectors[0])
        default = client.embeddings.create(model=export.name, input=TEXTS[0])  # the client asks for base64 and decodes it
        np.testing.assert_array_equal(np.array(default.data[0].embedding, np.float32), expected.vectors[0])
        short = client.embeddings.create(model=export.name, input=TEXTS[0], dimensions=32)
        assert len(short.data[0].embedding) == 32
        with pytest.raises(
            openai.BadRequestError, match="dimensions 17 is not a width this model was trained to give: use one of 16, 32, 64"
        ):
            client.embeddings.create(model=export.name, input=TEXTS[0], dimensions=17)
        with pytest.raises(openai.BadRequestError, match="context_length_exceeded|the model's context is 256"):
            client.embeddings.create(model=export.name, input=[list(range(3, 303))])
        cut = client.embeddings.create(model=export.name, input=[list(range(3, 303))], extra_body={"truncate": True})
        assert cut.usage.prompt_tokens == 256
        with pytest.raises(openai.BadRequestError, match="this model embeds text"):
            client.completions.create(model=export.name, prompt="Hi", max_tokens=2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_a_generation_model_refuses_embeddings_requests(tiny_llama):
    process, url = start(tiny_llama[1], "--provider", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="generates text; it does not embed"):
            client.embeddings.create(model=tiny_llama[1].name, input="Hi")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_an_embedding_model_beside_a_chat_model_in_one_server(embedding_models, tiny_llama):
    _, export = embedding_models[("mean", False)]
    process, url = start(None, "--provider", "cpu", "--model", str(tiny_llama[1]), "--model", str(export), "--keep-alive", "-1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        vectors = client.embeddings.create(model=export.name, input=TEXTS, encoding_format="float")
        expected = Engine.load(export, provider="cpu").embed(TEXTS).vectors
        np.testing.assert_allclose(np.array([d.embedding for d in vectors.data]), expected, atol=1e-6)
        text = client.completions.create(model=tiny_llama[1].name, prompt="Hi", max_tokens=4, temperature=0).choices[0].text
        assert text == Engine.load(tiny_llama[1], provider="cpu").generate("Hi", max_new_tokens=4).text
        assert {m.id: m.model_extra["loaded"] for m in client.models.list().data} == {tiny_llama[1].name: True, export.name: True}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_the_command_line_says_what_an_embedding_export_is_and_refuses_to_generate_with_it(embedding_models):
    import subprocess
    import sys

    _, export = embedding_models[("last", True)]
    info = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "info", str(export)], capture_output=True, text=True)
    assert info.returncode == 0 and "embedding model: 64 dimensions, last pooling, normalized" in info.stdout
    run = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", "Hi", "--model", str(export)], capture_output=True, text=True)
    assert run.returncode == 1 and "error: --model: this model embeds text" in run.stderr


def test_the_command_line_exports_an_embedding_model(embedding_models, tmp_path):
    """`edgeinfer export --task embedding --pooling --matryoshka`, as a user runs it."""
    import subprocess
    import sys

    hf, export = embedding_models[("mean", False)]
    command = [sys.executable, "-m", "edgeinfer.cli", "export", str(hf), "-o", str(tmp_path / "e"), "--task", "embedding"]
    done = subprocess.run([*command, "--pooling", "last", "--matryoshka", "16,32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (
        "last pooling (--pooling last, normalize from the sentence-transformers config); against transformers: cosine" in done.stderr
    )
    embedder = Engine.load(tmp_path / "e", provider="cpu")
    assert (embedder.pooling, embedder.normalize, embedder.matryoshka) == ("last", False, [16, 32])
    np.testing.assert_allclose(embedder.embed(TEXTS).vectors, reference(hf, TEXTS, "last", False), atol=1e-4)
    done = subprocess.run([*command, "--quantize", "int4"], capture_output=True, text=True)
    assert done.returncode == 1 and "--task embedding exports fp32 hidden states for now: leave out --quantize" in done.stderr


def test_embedding_work_leaves_the_other_routes_free_queues_within_bounds_and_stops_when_its_client_leaves(
    embedding_models, tiny_llama
):
    """Embeddings run on a thread of their own, at most 16 admitted: a one-token chat is answered
    while eight large embedding requests are still running or waiting, past 16 at once is a 429,
    and a client that leaves stops its work at the next batch."""
    import socket
    import threading

    import httpx
    from test_serve import metric, poll

    _, export = embedding_models[("mean", False)]
    large = {"model": export.name, "input": [[3 + (i * 7 + j) % 300 for j in range(255)] for i in range(256)]}
    process, url = start(None, "--provider", "cpu", "--model", str(tiny_llama[1]), "--model", str(export), "--keep-alive", "-1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        client.embeddings.create(model=export.name, input="load it")
        statuses = []

        def embed():
            statuses.append(httpx.post(f"{url}/v1/embeddings", json=large, timeout=120).status_code)

        senders = [threading.Thread(target=embed) for _ in range(24)]
        for sender in senders[:8]:
            sender.start()
        poll(url, lambda: metric(url, "edgeinfer_embedding_requests") >= 8, seconds=30)
        chat = client.chat.completions.create(model=tiny_llama[1].name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert chat.usage.completion_tokens == 1 and metric(url, "edgeinfer_embedding_requests") > 0  # answered meanwhile
        for sender in senders[8:]:
            sender.start()
        for sender in senders:
            sender.join(120)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 16  # 16 admitted at once; some ended meanwhile

        body = json.dumps(large).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            poll(url, lambda: metric(url, "edgeinfer_embedding_requests") >= 1, seconds=30)
        poll(url, lambda: metric(url, "edgeinfer_embedding_cancelled") == 1, seconds=30)
        poll(url, lambda: metric(url, "edgeinfer_embedding_requests") == 0, seconds=30)  # its work stopped
        for bad, message in [
            ([1.5], "input must be a string, a list of integers, a list of strings or a list of lists of integers"),
            ([""], "input[0]: String should have at least 1 character"),
        ]:
            with pytest.raises(openai.BadRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
                client.embeddings.create(model=export.name, input=bad)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
