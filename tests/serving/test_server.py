"""The OpenAI server, live on 127.0.0.1 (a free port), started and stopped by the tests.

The official ``openai`` client against the real tiny engine: completions, chat, streaming of
both, ``n > 1``, stop strings, logprobs (a stub engine while the sampler has none); greedy and
seeded results equal ``LLM.generate`` on a second engine with the same seeded weights. Prompts
stay within one PAGE, so no request resumes from another's prefix hit (under the default
``replay`` transfer such a request may differ from a cold run). Every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, fields

import pytest

from tests.serving.helpers import ROOT, TINY, fake_llm, prompt
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from v41plan.serving.openai_server import OpenAIServer, start_in_thread

OPTIONS = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
PROMPTS = ["The sky is", "Once upon a", "hello world", "1, 2, 3,"]


@pytest.fixture(scope="module")
def offline():
    """A second engine with the server's seeded random weights: the offline results."""
    return LLM("tiny", world_size=1, **OPTIONS)


@pytest.fixture(scope="module")
def live():
    """The real tiny engine served on a free port."""
    server = OpenAIServer(LLM("tiny", world_size=1, **OPTIONS), max_waiting=512)
    bg = start_in_thread(server)
    yield bg
    bg.stop(grace_s=1.0)
    assert not bg.thread.is_alive()


def client(bg, **kw):
    return openai.OpenAI(base_url=bg.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)


def offline_texts(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]


def metrics(bg) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value} (labels other than model_name kept)."""
    text = urllib.request.urlopen(bg.url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r',?model_name="[^"]*",?', "", key).replace("{}", "")
        out[key] = float(value)
    return out


def post(bg, path, body, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        bg.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


# ---- results equal the offline engine ------------------------------------------------------


def test_completions_greedy_equal_generate(live, offline):
    want, ids = offline_texts(offline, PROMPTS, SamplingParams(max_tokens=8))
    c = client(live)
    r = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    assert r.usage.completion_tokens == sum(len(i) for i in ids)
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)
    one = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert one.choices[0].text == want[0]
    assert one.choices[0].finish_reason in ("length", "stop")
    tok = c.completions.create(
        model="tiny", prompt=list(PROMPTS[1].encode()), max_tokens=8, temperature=0
    )
    assert tok.choices[0].text == want[1]


def test_seeded_sampling_and_n_equal_generate(live, offline):
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7 + i, max_tokens=8)
        for i in range(3)
    ]
    want, _ = offline_texts(offline, [PROMPTS[2]] * 3, params)
    r = client(live).completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=8,
        temperature=0.8,
        top_p=0.95,
        seed=7,
        n=3,
        extra_body={"top_k": 50},
    )
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want


def test_identical_greedy_requests_together_agree(live, offline):
    want, _ = offline_texts(offline, [PROMPTS[3]], SamplingParams(max_tokens=6))
    r = client(live).completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=6, temperature=0, n=4
    )
    assert [ch.text for ch in r.choices] == want * 4


def test_chat_and_streams_equal_generate(live, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = offline.tokenizer.apply_chat_template(messages)
    assert offline.decode(ids) == "system: be brief\nuser: hi\nassistant:"
    want, toks = offline_texts(offline, [{"prompt_token_ids": ids}], SamplingParams(max_tokens=8))
    c = client(live)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(toks[0])
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want[0]
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == r.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    text_want, _ = offline_texts(offline, PROMPTS[:2], SamplingParams(max_tokens=8))
    stream = c.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=0, stream=True
    )
    parts = ["", ""]
    for ch in stream:
        for choice in ch.choices:
            parts[choice.index] += choice.text
    assert parts == text_want


def _stop_case(offline):
    """A prompt whose greedy text holds a two-character stop string past its start (the first
    prompt usually does; the loop is bounded)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(40):
        p = f"stop case {i}:"
        out = offline.generate([p], params)[0].outputs[0]
        text = out.text
        for j in range(2, len(text) - 2):
            s = text[j : j + 2]
            if "\ufffd" not in s and s.isprintable() and text.index(s) == j:
                return p, s, text, out.token_ids
    pytest.fail("no usable stop string in 40 prompts")


def test_stop_strings_streamed_and_not(live, offline):
    p, stop, text, ids = _stop_case(offline)
    want = text[: text.index(stop)]
    n_tok = next(k for k in range(1, len(ids) + 1) if stop in offline.decode(ids[:k]))
    c = client(live)
    kw = {
        "model": "tiny",
        "prompt": p,
        "max_tokens": 16,
        "temperature": 0,
        "stop": [stop, "\u2603\u2603"],
        "extra_body": {"ignore_eos": True},
    }
    r = c.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens == n_tok
    got = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
    assert got == want
    eos = c.completions.create(
        model="tiny",
        prompt=p,
        max_tokens=16,
        temperature=0,
        stop=[ids[2]],
        extra_body={"ignore_eos": True},
    )
    assert eos.choices[0].finish_reason == "stop" and eos.usage.completion_tokens == 3
    assert eos.choices[0].text == offline.decode(ids[:2])  # the stop token's text is cut


def test_logprobs_when_the_engine_has_none(live):
    if "logprobs" in {f.name for f in fields(SamplingParams)}:
        r = client(live).completions.create(model="tiny", prompt="a", max_tokens=3, logprobs=2)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
        return
    status, body, _ = post(live, "/v1/completions", {"prompt": "a", "logprobs": 2})
    assert status == 400 and "logprobs are not available" in body["error"]["message"]
    status, body, _ = post(
        live,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 1},
    )
    assert status == 400 and body["error"]["param"] == "top_logprobs"


@dataclass(frozen=True)
class StubParams(SamplingParams):
    """Sampling params with a top-n logprobs field (the stub engine fills them)."""

    logprobs: int | None = None


class StubLogprobLLM(LLM):
    """The fake engine plus ``Sequence.output_logprobs``: ``-(token % 7) / 8`` for the chosen
    token and ``logprobs`` alternatives."""

    def step(self):
        done = super().step()
        for seq in list(self.scheduler.running) + done:
            lp = seq.__dict__.setdefault("output_logprobs", [])
            for t in seq.output_ids[len(lp) :]:
                top = {(t + k) % 256: -(t % 7) / 8 - k for k in range(seq.params.logprobs or 0)}
                lp.append((-(t % 7) / 8, top))
        return done


def test_logprobs_formatting_with_a_stub_engine():
    from tests.serving.helpers import fake_factory

    llm = StubLogprobLLM(TINY, runner_factory=fake_factory, world_size=1)
    bg = start_in_thread(OpenAIServer(llm, params_cls=StubParams))
    try:
        c = client(bg)
        r = c.completions.create(
            model="tiny",
            prompt="ab",
            max_tokens=4,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert lp.text_offset[0] == 0
        ref = StubLogprobLLM(TINY, runner_factory=fake_factory, world_size=1)
        seq = ref.add_request(list(b"ab"), StubParams(max_tokens=4, ignore_eos=True, logprobs=2))
        ref.run_until_done(max_steps=50)
        assert lp.token_logprobs == [e[0] for e in seq.output_logprobs]
        assert lp.tokens == [ref.decode([t]) for t in seq.output_ids]
        assert lp.top_logprobs == [
            {ref.decode([k]): v for k, v in e[1].items()} for e in seq.output_logprobs
        ]
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        chat = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            extra_body={"ignore_eos": True},
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == 3 and all(len(e.top_logprobs) == 1 for e in content)
        assert all(e.logprob == e.top_logprobs[0].logprob for e in content)
        stream = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = [
            e
            for ch in stream
            if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content
        ]
        assert [e.logprob for e in streamed] == [e.logprob for e in content]
    finally:
        bg.stop(grace_s=0.5)


# ---- the other endpoints -------------------------------------------------------------------


def test_models_health_tokenize_detokenize(live):
    models = client(live).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert urllib.request.urlopen(live.url + "/health", timeout=30).status == 200
    status, body, _ = post(live, "/tokenize", {"prompt": "hi!"})
    assert status == 200 and body["tokens"] == [104, 105, 33] and body["count"] == 3
    status, body, _ = post(live, "/detokenize", {"tokens": [104, 105]})
    assert status == 200 and body["prompt"] == "hi"
    status, body, _ = post(live, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and bytes(body["tokens"]).decode() == "user: x\nassistant:"


BAD = [
    # (name, path, body (raw bytes when bytes), status, error type, param)
    ("bad json", "/v1/completions", b"{not json", 400, "invalid_request_error", None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "invalid_request_error", None),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, 400,
     "invalid_request_error", "model"),
    ("unknown field", "/v1/completions", {"prompt": "a", "tempurature": 1}, 400,
     "invalid_request_error", "tempurature"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "invalid_request_error", "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "invalid_request_error", "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 999]}, 400,
     "invalid_request_error", "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens bool", "/v1/completions", {"prompt": "a", "max_tokens": True}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     "invalid_request_error", "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "a", "temperature": -1}, 400,
     "invalid_request_error", "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "a", "top_p": 0}, 400,
     "invalid_request_error", "top_p"),
    ("top_k wrong type", "/v1/completions", {"prompt": "a", "top_k": 1.5}, 400,
     "invalid_request_error", "top_k"),
    ("n too large", "/v1/completions", {"prompt": "a", "n": 1000}, 400,
     "invalid_request_error", "n"),
    ("seed negative", "/v1/completions", {"prompt": "a", "seed": -3}, 400,
     "invalid_request_error", "seed"),
    ("stop wrong type", "/v1/completions", {"prompt": "a", "stop": [1.5]}, 400,
     "invalid_request_error", "stop"),
    ("too many stop strings", "/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, 400,
     "invalid_request_error", "stop"),
    ("stop_options without stream", "/v1/completions",
     {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "invalid_request_error",
     "stream_options"),
    ("logprobs too many", "/v1/completions", {"prompt": "a", "logprobs": 50}, 400,
     "invalid_request_error", "logprobs"),
    ("prompt too long", "/v1/completions", {"prompt": [65] * 4096}, 400,
     "invalid_request_error", "prompt"),
    ("prompt plus max_tokens too long", "/v1/completions",
     {"prompt": [65] * 4000, "max_tokens": 200}, 400, "invalid_request_error", "max_tokens"),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, 400, "invalid_request_error",
     "echo"),
    ("chat no messages", "/v1/chat/completions", {"messages": []}, 400,
     "invalid_request_error", "messages"),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]},
     400, "invalid_request_error", "messages"),
    ("chat tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "tools": []}, 400,
     "invalid_request_error", "tools"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "invalid_request_error", "top_logprobs"),
    ("unknown path", "/v1/embeddings", {"input": "a"}, 404, "not_found_error", None),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_never_reach_the_engine(live, case):
    _, path, body, status, err_type, param = case
    before = live.server.engine.submitted
    raw = body if isinstance(body, bytes) else None
    got, resp, _ = post(live, path, None if raw else body, raw=raw)
    assert got == status, resp
    assert resp["error"]["type"] == err_type and resp["error"]["code"] == status
    assert resp["error"]["param"] == param and resp["error"]["message"]
    assert live.server.engine.submitted == before


def test_api_key_and_full_queue_and_engine_errors():
    from tests.serving.helpers import failing_factory

    poison = 13
    # a prompt holding the poison id fails its batch
    factory = failing_factory(lambda batch: any(poison in d.new_tokens for d in batch.deltas))
    llm = LLM(TINY, runner_factory=factory, world_size=1, max_num_seqs=1)
    bg = start_in_thread(OpenAIServer(llm, api_key="sesame", max_waiting=0))
    try:
        status, body, _ = post(bg, "/v1/completions", {"prompt": "a"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=bg.url + "/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=bg.url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        auth = {"Authorization": "Bearer sesame"}
        status, body, headers = post(bg, "/v1/completions", {"prompt": "a", "n": 2}, auth)
        assert status == 503 and headers.get("retry-after") == "1"
        status, body, _ = post(bg, "/v1/completions", {"prompt": [poison] * 4}, auth)
        assert status == 500 and "injected kernel failure" in body["error"]["message"]
        stream = c.completions.create(model="tiny", prompt=[poison] * 3, stream=True)
        with pytest.raises(openai.APIError, match="injected kernel failure"):
            list(stream)
        ok = c.completions.create(model="tiny", prompt=prompt(5), max_tokens=3)
        assert ok.choices[0].finish_reason in ("length", "stop")
    finally:
        bg.stop(grace_s=0.5)


# ---- many clients, disconnects, and nothing left behind -------------------------------------


def _stream_raw(url: str, body: dict, drop_after: int | None, out: dict, key: int) -> None:
    """One SSE client over http.client; closes the socket after ``drop_after`` chunks."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        text, chunks, finish = "", 0, None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                out[key] = ("done", text, finish)
                return
            data = json.loads(line[6:])
            choice = data["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                out[key] = ("dropped", text, None)
                conn.sock.close()
                return
        out[key] = ("eof", text, finish)
    except Exception as exc:  # noqa: BLE001 - recorded and asserted on
        out[key] = ("error", repr(exc), None)
    finally:
        conn.close()


def test_64_streaming_clients_with_disconnects(live, offline):
    n_clients = 64
    prompts = [f"client {i:02d} says" for i in range(n_clients)]
    want, _ = offline_texts(offline, prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    before = metrics(live)
    # 20% (13 of 64) leave after two chunks of a long answer: only an abort can finish them.
    drops = {i for i in range(n_clients) if i % 5 == 2}
    out: dict = {}
    threads = [
        threading.Thread(
            target=_stream_raw,
            args=(
                live.url,
                {
                    "prompt": p,
                    "max_tokens": 200 if i in drops else 4,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
                2 if i in drops else None,
                out,
                i,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    for i in range(n_clients):
        state, text, finish = out[i]
        if i in drops:
            assert state == "dropped"
        else:
            assert (state, finish) == ("done", "length"), out[i]
            assert text == want[i]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = metrics(live)
        if m["v41plan:num_requests_running"] == m["v41plan:num_requests_waiting"] == 0 and (
            m["v41plan:num_slots_in_use"] == m["v41plan:num_pages_in_use"] == 0
        ):
            break
        time.sleep(0.1)
    assert m["v41plan:num_requests_running"] == m["v41plan:num_requests_waiting"] == 0
    assert m["v41plan:num_slots_in_use"] == m["v41plan:num_pages_in_use"] == 0
    assert m["v41plan:kv_cache_usage_perc"] == m["v41plan:state_cache_usage_perc"] == 0
    done_key = 'v41plan:request_success_total{finished_reason="length"}'
    abort_key = 'v41plan:request_success_total{finished_reason="abort"}'
    assert m[done_key] - before[done_key] == n_clients - len(drops)
    assert m[abort_key] - before[abort_key] == len(drops)
    ttft = "v41plan:time_to_first_token_seconds_count"
    assert m[ttft] - before[ttft] == n_clients
    itl = "v41plan:inter_token_latency_seconds_count"
    assert m[itl] - before[itl] >= 3 * (n_clients - len(drops))
    assert m["v41plan:prefix_cache_queries_total"] > 0


# ---- the command line ------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_says_random_weights_and_drains_on_sigterm():
    import signal

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "v41plan",
            "serve",
            "--port",
            str(port),
            "--max-num-seqs",
            "2",
            "--grace-s",
            "0.5",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = proc.stdout.readline()
        assert "RANDOM weights" in banner and "tiny" in banner, banner
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        out: dict = {}
        body = {
            "prompt": "a",
            "max_tokens": 3000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        t = threading.Thread(target=_stream_raw, args=(url, body, None, out, 0))
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert out[0][0] == "done" and out[0][2] == "abort", out
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_fake_engine_server_roundtrip():
    """The server over the fake runner (fast path sanity: one request each way)."""
    bg = start_in_thread(OpenAIServer(fake_llm()))
    try:
        r = client(bg).completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert r.usage.completion_tokens <= 2
    finally:
        bg.stop(grace_s=0.5)


def test_speculative_server_serves_the_plain_greedy_tokens_and_counts_acceptance():
    """``speculative_config`` on a served engine: greedy completions equal a plain engine's,
    and ``/metrics`` carries the acceptance counters."""
    dspark = {"method": "dspark", "num_speculative_tokens": 5}
    opts = {"max_num_seqs": 4, "dtype": "float64"}
    plain = LLM("tiny40_dspark", world_size=1, **opts)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _, want = offline_texts(plain, PROMPTS[:2], params)
    server = OpenAIServer(LLM("tiny40_dspark", world_size=1, speculative_config=dspark, **opts))
    bg = start_in_thread(server)
    try:
        c = client(bg)
        for p, ids in zip(PROMPTS[:2], want, strict=True):
            r = c.completions.create(
                model=server.model_name, prompt=p, max_tokens=8, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == plain.decode(ids)
        m = metrics(bg)
        drafts = m["v41plan:spec_decode_num_drafts_total"]
        assert m["v41plan:spec_decode_num_draft_tokens_total"] == 5 * drafts
        hist = {
            int(re.search(r'accepted_len="(\d+)"', k).group(1)): v
            for k, v in m.items()
            if k.startswith("v41plan:spec_decode_accepted_length_total")
        }
        assert sum(hist.values()) == drafts >= 2
        # each request's first token comes from its prefill, the other 7 from verify steps
        # (a + 1 each; the last step of a request may be cut by max_tokens)
        assert sum((a + 1) * n for a, n in hist.items()) >= 2 * 7
    finally:
        bg.stop(grace_s=1.0)
