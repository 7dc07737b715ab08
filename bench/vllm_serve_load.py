"""A client of vLLM's OpenAI server sending what users send: /v1/completions with token-id
prompts, streamed or not, many at once, some abandoned mid-stream, some bad; and the server's
KV cache usage from /metrics. `tools/device/vllm_gpu.py --phases serve` runs `check_server`
against `vllm serve` on the GPU machine; tests/vllm_platform/serve_storm_test.py runs
`run_storm` against it on the CPU.

Every request asks for greedy tokens (temperature 0, ignore_eos) and the token ids back, so
a request's answer can be compared with the same request sent alone.
"""

import concurrent.futures
import contextlib
import json
import socket
import subprocess
import time

import requests


@contextlib.contextmanager
def running_server(command, log_path, timeout_s=600, **popen):
    """Runs `command` (`vllm serve ...`, without --host and --port) on a free loopback port,
    its output to log_path; yields (url, process) once /health answers, raising with the
    log's tail if it exits or does not answer within timeout_s; terminates it at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n"
                                   + open(log_path).read()[-6000:])
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer within {timeout_s} s:\n"
                                   + open(log_path).read()[-6000:])
            time.sleep(1)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def complete(url, model, prompt, max_tokens, stream=False, disconnect_after=None, **fields):
    """One completion: {"status", "tokens", "error"}. A streamed request whose client leaves
    after `disconnect_after` tokens closes its connection there ("disconnected": True)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **fields}
    with requests.post(url + "/v1/completions", json=body, stream=stream, timeout=600) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "tokens": None, "error": r.text}
        if not stream:
            return {"status": 200, "tokens": r.json()["choices"][0]["token_ids"], "error": None}
        tokens = []
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
            if disconnect_after is not None and len(tokens) >= disconnect_after:
                return {"status": 200, "tokens": tokens, "error": None, "disconnected": True}
        return {"status": 200, "tokens": tokens, "error": None}


def metric(url, name):
    """The sum of a metric's samples (over their labels) on the server's /metrics."""
    text = requests.get(url + "/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{")]
    if not values:
        raise RuntimeError(f"/metrics has no {name}")
    return sum(values)


def kv_cache_usage(url):
    """The server's KV cache usage, 0 to 1."""
    return metric(url, "vllm:kv_cache_usage_perc")


def finished(url):
    """How many requests the server finished (stopped or at their length; vLLM 0.13 does not
    count aborted ones)."""
    return metric(url, "vllm:request_success_total")


def in_flight(url):
    """The server's requests running or waiting."""
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")


def wait_until_idle(url, timeout_s=60):
    """Seconds until the server had no request in flight and its KV cache usage read 0; None
    if that did not happen within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if in_flight(url) == 0 and kv_cache_usage(url) == 0:
            return round(time.monotonic() - start, 2)
        time.sleep(0.2)
    return None


def send_all(url, model, requests_, concurrency):
    """Each request (a dict of complete()'s arguments after url and model), `concurrency` at
    a time; their answers in order."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda kw: complete(url, model, **kw), requests_))


def check_server(url, model, prompts, vocab_size, max_model_len, max_tokens=16, concurrent=64):
    """What a serving user relies on, checked against a running server; a record of what held
    ("ok" per check) and what was seen.

    - solo: each prompt alone, not streamed, then streamed: the same tokens;
    - concurrent: `concurrent` requests at once (the prompts in turn, streamed and not): each
      answer equals its prompt's solo answer;
    - bad: a token id past the vocabulary gets a 4xx naming it, max_tokens 0 a 4xx, and the
      next request is served with its solo answer;
    - disconnects: streamed requests for as many tokens as max_model_len allows, left after 2
      tokens, are aborted (those that did not reach their length first; at least one) and
      free their KV blocks: /metrics shows no request in flight and a KV cache usage of 0."""
    record = {}
    solo = [complete(url, model, p, max_tokens) for p in prompts]
    streamed = [complete(url, model, p, max_tokens, stream=True) for p in prompts]
    record["solo"] = {"ok": all(s["status"] == 200 for s in solo) and
                      [s["tokens"] for s in streamed] == [s["tokens"] for s in solo],
                      "tokens": [s["tokens"] for s in solo],
                      "errors": [s["error"] for s in solo + streamed if s["error"]]}
    load = [{"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "stream": i % 2 == 1}
            for i in range(concurrent)]
    tic = time.monotonic()
    answers = send_all(url, model, load, concurrent)
    wrong = [i for i, a in enumerate(answers)
             if a["tokens"] != solo[i % len(prompts)]["tokens"]]
    record["concurrent"] = {"ok": not wrong, "requests": concurrent, "differ": wrong,
                            "wall_s": round(time.monotonic() - tic, 2)}
    out_of_vocabulary = complete(url, model, [1, 2, vocab_size + 5], max_tokens)
    zero_tokens = complete(url, model, prompts[0], 0)
    after = complete(url, model, prompts[0], max_tokens)
    record["bad"] = {"ok": 400 <= out_of_vocabulary["status"] < 500
                     and str(vocab_size + 5) in (out_of_vocabulary["error"] or "")
                     and 400 <= zero_tokens["status"] < 500
                     and after["tokens"] == solo[0]["tokens"],
                     "out_of_vocabulary": [out_of_vocabulary["status"],
                                           (out_of_vocabulary["error"] or "")[:300]],
                     "max_tokens_0": [zero_tokens["status"], (zero_tokens["error"] or "")[:300]]}
    leaving = [{"prompt": p, "max_tokens": max_model_len - len(p), "stream": True,
                "disconnect_after": 2} for p in (prompts * 16)[:16]]
    finished_before = finished(url)
    left = send_all(url, model, leaving, 16)
    seconds_to_idle = wait_until_idle(url)
    finished_anyway = int(finished(url) - finished_before)
    # A request leaves the server finished (at its length, if it got there before the server
    # saw its client leave) or aborted; the aborted ones must have freed their blocks too.
    record["disconnects"] = {"requests": len(left),
                             "left_after_tokens": sorted({len(a["tokens"] or []) for a in left}),
                             "aborted": len(left) - finished_anyway,
                             "finished_anyway": finished_anyway,
                             "seconds_to_idle_and_empty_cache": seconds_to_idle}
    record["disconnects"]["ok"] = (all(a.get("disconnected") for a in left)
                                   and finished_anyway < len(left) and seconds_to_idle is not None)
    record["ok"] = all(v["ok"] for v in record.values() if isinstance(v, dict))
    return record


def storm_requests(prompts, vocab_size, max_model_len, count=200, tokens=16):
    """A storm's requests, as (kind, complete()'s arguments, for bad ones the words their error
    must hold): one in 20 bad (cycling through a token id past the vocabulary, max_tokens 0 and
    -1, a prompt longer than max_model_len, a sampling field the platform refuses), one in 5
    streamed and left after 2 tokens, the rest good, streamed or not, for 1 to `tokens`
    tokens."""
    bad = [
        ({"prompt": [1, 2, vocab_size + 3], "max_tokens": 4}, f"Token id {vocab_size + 3}"),
        ({"prompt": prompts[0], "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"prompt": prompts[0], "max_tokens": -1}, "max_tokens must be at least 1"),
        ({"prompt": [1] * (max_model_len + 1), "max_tokens": 4}, "maximum context length"),
        ({"prompt": prompts[0], "max_tokens": 4, "repetition_penalty": 1.5}, "repetition_penalty"),
    ]
    storm = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        if i % 20 == 7:
            fields, words = bad[(i // 20) % len(bad)]
            storm.append(("bad", fields, words))
        elif i % 5 == 3:  # never one of the bad ones (i % 20 == 7)
            storm.append(("left", {"prompt": prompt, "max_tokens": max_model_len - len(prompt),
                                   "stream": True, "disconnect_after": 2}, None))
        else:
            storm.append(("good", {"prompt": prompt, "max_tokens": 1 + i % tokens,
                                   "stream": i % 2 == 1}, None))
    return storm


def run_storm(url, model, prompts, vocab_size, max_model_len, count=200, concurrency=32,
              tokens=16):
    """Each prompt alone first (its greedy tokens, of which a good request's must be the first
    max_tokens), then the storm, `concurrency` at a time; what went wrong, by kind, and what
    was seen (the server's state after it is the caller's to check: wait_until_idle)."""
    solo = {tuple(p): complete(url, model, p, tokens)["tokens"] for p in prompts}
    storm = storm_requests(prompts, vocab_size, max_model_len, count, tokens)
    tic = time.monotonic()
    answers = send_all(url, model, [fields for _, fields, _ in storm], concurrency)
    wrong = {"good": [], "bad": [], "left": []}
    for i, ((kind, fields, words), answer) in enumerate(zip(storm, answers)):
        if kind == "good":
            ok = answer["tokens"] == solo[tuple(fields["prompt"])][:fields["max_tokens"]]
        elif kind == "bad":
            ok = 400 <= answer["status"] < 500 and words in (answer["error"] or "")
        else:
            ok = answer.get("disconnected", False)
        if not ok:
            wrong[kind].append({"request": i, "fields": {k: v for k, v in fields.items()
                                                         if k != "prompt"},
                                "status": answer["status"], "tokens": answer["tokens"],
                                "error": (answer["error"] or "")[:300]})
    return {"requests": {kind: sum(k == kind for k, _, _ in storm) for kind in wrong},
            "wrong": wrong, "wall_s": round(time.monotonic() - tic, 2)}
