"""``xoffload serve`` end to end on the CPU: a real uvicorn server on a free port over the tiny
random model (given a byte-level tokenizer with a chat template), driven by the ``openai`` client:
completions and chat, streaming (deltas concatenate to the non-streamed text), 16 concurrent
clients equal to offline ``LLM.generate``, follow-up turns (chat, token ids) served from the prefix
cache with the whole previous prompt reused, a
client gone mid-stream (its blocks freed), every bad input a 400 with OpenAI's error object, 429
past the queue, 401 without the API key."""
import copy
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from engine.llm_helpers import tiny_random  # noqa: E402

from xoffload.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from xoffload.serve import create_app  # noqa: E402
from xoffload.serve.background import BackgroundServer  # noqa: E402

NAME = "tiny-bytes"
OPTS = dict(mode="offload", offload_decode="direct", kv_block_size=16, max_model_len=512, max_num_seqs=4,
            prefix_caching=True, prefill_attn="sdpa")
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def byte_tokenizer():
    """A transformers tokenizer whose 256 ids are the 256 bytes (GPT-2's byte-to-unicode map, no
    merges), with a small chat template: real decoding, partial UTF-8 characters included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def model():
    m = copy.copy(tiny_random())  # the cached weights, with a tokenizer of its own
    m.tokenizer = byte_tokenizer()
    return m


@pytest.fixture(scope="module")
def server(model):
    app = create_app(LLMEngine(model, **OPTS), NAME)
    with BackgroundServer(app, graceful_s=2.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r'model="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return out


def test_models_health_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    m = _metrics(server)
    assert m["xoffload_requests_running"] == 0 and 'xoffload_kv_blocks{pool="host",state="total"}' in m


def test_completion_and_chat(client):
    c = client.completions.create(model=NAME, prompt="Hello there", max_tokens=8, temperature=0)
    assert c.object == "text_completion" and isinstance(c.choices[0].text, str)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
    assert c.usage.prompt_tokens == len("Hello there") and c.usage.total_tokens == c.usage.prompt_tokens + 8
    ids = client.completions.create(model=NAME, prompt=list(b"Hello there"), max_tokens=8, temperature=0)
    assert ids.choices[0].text == c.choices[0].text  # token ids and the string they spell
    ch = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                        max_completion_tokens=6, temperature=0, seed=3)
    assert ch.object == "chat.completion" and ch.choices[0].message.role == "assistant"
    assert ch.usage.prompt_tokens == len("<user> Hi\n<assistant> ") and ch.usage.completion_tokens == 6
    sampled = client.completions.create(model=NAME, prompt="abc", max_tokens=6, temperature=1.0, top_p=0.9, extra_body={"top_k": 20},
                                        seed=7)
    again = client.completions.create(model=NAME, prompt="abc", max_tokens=6, temperature=1.0, top_p=0.9, extra_body={"top_k": 20},
                                      seed=7)
    assert sampled.choices[0].text == again.choices[0].text  # seeded


def test_streaming_deltas_equal_the_text(client):
    for prompt in ("Stream me", "é€ bytes"):
        whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
        assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    msgs = [{"role": "user", "content": "Tell me"}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_stop_strings_and_ids(client, model):
    base = client.completions.create(model=NAME, prompt="stop test", max_tokens=30, temperature=0).choices[0].text
    cut = next((i for i in range(3, len(base)) if base[i - 2:i].isprintable() and base[i - 2:i] not in base[:i - 1]
                and "\ufffd" not in base[i - 2:i]), None)
    if cut is None:
        pytest.skip("no printable two-character stop in this output")
    stop = base[cut - 2:cut]
    c = client.completions.create(model=NAME, prompt="stop test", max_tokens=30, temperature=0, stop=[stop])
    assert c.choices[0].text == base[:cut - 2] and c.choices[0].finish_reason == "stop"
    s = list(client.completions.create(model=NAME, prompt="stop test", max_tokens=30, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(x.choices[0].text for x in s) == base[:cut - 2] and s[-1].choices[0].finish_reason == "stop"
    toks = LLM(model, **OPTS).generate("stop test", SamplingParams(max_tokens=30))[0].token_ids
    tid = toks[5]
    byid = client.completions.create(model=NAME, prompt="stop test", max_tokens=30, temperature=0,
                                     extra_body={"stop": [tid]})
    want = model.tokenizer.decode(toks[:toks.index(tid)])
    assert byid.choices[0].finish_reason == "stop" and byid.choices[0].text == want
    assert byid.usage.completion_tokens == toks.index(tid) + 1  # the stop token counts, its text is not sent


def test_16_concurrent_clients_equal_offline_generate(client, model):
    prompts = [f"User {i}: what is {i} + {i * 7}?" + " pad" * (i % 5) for i in range(16)]
    got = [None] * 16

    def ask(i):
        got[i] = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=12, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    offline = LLM(model, **OPTS).generate(prompts, SamplingParams(max_tokens=12))
    assert [g.choices[0].text for g in got] == [o.text for o in offline]


def test_follow_up_turn_reads_the_prefix_cache(client):
    doc = "A long document about caching. " * 6
    msgs = [{"role": "user", "content": doc + "Question one?"}]
    first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Question two?"}]
    second = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the template renders the history as the first turn's prompt and more: all of that prompt's KV
    # is reused (the answer's own KV is not: the random model's bytes need not decode and encode
    # back to the same ids)
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_follow_up_of_token_ids_reuses_the_previous_prompt_and_answer(client, model):
    """A client that re-sends the conversation as token ids (its prompt, the answer's ids, a new
    question) gets the whole previous prompt and answer, but the answer's last token (never fed to
    a decode step), from the prefix cache, as the engine does."""
    tok = model.tokenizer
    p1 = tok.encode("Ids all the way: a document to keep. " * 5, add_special_tokens=False)
    first = client.completions.create(model=NAME, prompt=p1, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens == len(p1)
    answer = LLM(model, **OPTS).generate([p1], SamplingParams(max_tokens=6))[0].token_ids  # the same greedy ids
    p2 = p1 + list(answer) + tok.encode(" And then?", add_special_tokens=False)
    second = client.completions.create(model=NAME, prompt=p2, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == len(p2)
    assert second.usage.prompt_tokens_details.cached_tokens == len(p1) + len(answer) - 1


def test_disconnect_mid_stream_frees_blocks(server, client):
    before = _metrics(server).get('xoffload_requests_finished_total{reason="abort"}', 0)
    stream = client.completions.create(model=NAME, prompt="never mind " * 8, max_tokens=400, temperature=0,
                                       stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m.get('xoffload_requests_finished_total{reason="abort"}', 0) > before and m["xoffload_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m.get('xoffload_requests_finished_total{reason="abort"}', 0) == before + 1
    assert m['xoffload_kv_blocks{pool="host",state="used"}'] == 0
    host = {s: m[f'xoffload_kv_blocks{{pool="host",state="{s}"}}'] for s in ("free", "cached", "total")}
    assert host["free"] + host["cached"] == host["total"]
    assert m["xoffload_generation_tokens_total"] > 0


BAD = [  # (route, body or raw text, param)
    ("completions", "{not json", None),
    ("completions", "[1, 2]", None),
    ("completions", {"model": NAME, "prompt": 5}, "prompt"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("completions", {"model": "other", "prompt": "x"}, "model"),
    ("completions", {"prompt": "x"}, "model"),
    ("completions", {"model": NAME, "prompt": "x" * 600}, "prompt"),
    ("completions", {"model": NAME, "prompt": [1] * 513}, "prompt"),
    ("completions", {"model": NAME, "prompt": [1, 999]}, "prompt"),
    ("completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"model": NAME, "prompt": "x", "n": 2}, "n"),
    ("completions", {"model": NAME, "prompt": "x", "logprobs": 2}, "logprobs"),
    ("completions", {"model": NAME, "prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"model": NAME, "prompt": "x", "stop": [""]}, "stop"),
    ("chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("chat/completions", {"model": NAME, "messages": "hi"}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
]


@pytest.mark.parametrize("route,body,param", BAD)
def test_bad_input_is_a_400_with_the_error_object(server, route, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{server.url}/v1/{route}", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "still up", "max_tokens": 2})
    assert ok.status_code == 200  # the engine keeps serving


def test_chat_without_a_template_is_a_400():
    app = create_app(LLMEngine(tiny_random(), mode="resident", max_model_len=128, prefill_attn="sdpa"), "plain")
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "plain", "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "plain", "prompt": "hi"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "plain", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_queue_limit_429_and_api_key_401(model):
    app = create_app(LLMEngine(model, mode="resident", max_model_len=512, prefill_attn="sdpa"), NAME, api_key="k3y",
                     max_queue=0)
    with BackgroundServer(app) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k3y", max_retries=0)
        stream = c.completions.create(model=NAME, prompt="busy", max_tokens=500, temperature=0, stream=True)
        next(iter(stream))  # one running (max_num_seqs=1), none may wait
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"},
                       headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        stream.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and app.state.loop.active:
            time.sleep(0.05)
        assert c.completions.create(model=NAME, prompt="free again", max_tokens=2).usage.completion_tokens == 2


def test_shutdown_lets_requests_run_then_ends_them(model):
    app = create_app(LLMEngine(model, **OPTS), NAME, shutdown_timeout=1.0)
    srv = BackgroundServer(app, graceful_s=10.0).start()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    stream = c.completions.create(model=NAME, prompt="long", max_tokens=480, temperature=0, stream=True)
    it = iter(stream)
    next(it)
    t = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = list(it)  # the stream runs on while draining, then ends with its last chunk
    assert rest[-1].choices[0].finish_reason == "abort" and len(rest) > 1
    stopper.join()
    assert time.monotonic() - t < 8
    assert app.state.loop.active == 0 and not app.state.loop._thread.is_alive() and app.state.loop.engine.closed


def test_sampling_without_a_seed_varies(client):
    outs = {client.completions.create(model=NAME, prompt="vary", max_tokens=8, temperature=1.0).choices[0].text
            for _ in range(4)}
    assert len(outs) > 1  # a fresh seed per request, not the engine's one default seed
