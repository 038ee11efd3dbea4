"""Two router replicas on one Redis: shared prefix index and loads, and Redis outages.

Router B polls the workers once, at start, and never again (``--poll-interval-s
600``): whatever it knows afterwards about caches and loads came through Redis.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from pdd.common.block_hash import block_hashes
from pdd.router.chat_template import render_plain
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

MODEL = "tiny"
FROZEN = ("--poll-interval-s", "600")
#: These tests are about what replicas share, not about the Redis deadline: a loaded
#: machine may answer later than the default 0.25 s, which would (rightly) route on local
#: state and make a replica miss what the other one wrote.
PATIENT = ("--redis-deadline-s", "30")


def chat(router, messages, max_tokens=16) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def route(resp: httpx.Response) -> dict[str, tuple[str, int]]:
    """``x-pdd-route`` as {role: (instance, hit tokens)}."""
    hops = {}
    for hop in resp.headers["x-pdd-route"].split():
        role, _, rest = hop.partition("=")
        instance, _, hit = rest.partition(":")
        hops[role] = (instance, int(hit or 0))
    return hops


@pytest.fixture
def replicas(own_redis, worker_flags, start_router):
    a = start_router(*worker_flags(), "--redis", own_redis.url, "--replica-id", "a", *PATIENT)
    b = start_router(
        *worker_flags(), "--redis", own_redis.url, "--replica-id", "b", *FROZEN, *PATIENT
    )
    return a, b


def test_conversation_turns_land_on_one_md_across_replicas(replicas, own_redis):
    a, b = replicas
    messages = [{"role": "user", "content": "Plan a trip to Paris in spring, day by day."}]
    first = chat(a, messages)
    md = route(first)["main"][0]
    r = redis.Redis.from_url(own_redis.url)
    first_block = block_hashes(list(render_plain(messages).encode()), 16)[0]
    until_sync(lambda: r.hexists(f"pdd:idx:h:{first_block}", md), "A did not publish MD's blocks")
    for replica in (b, a, b):
        answer = first.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
        first = chat(replica, messages)
        instance, hit = route(first)["main"]
        assert instance == md
        assert hit >= 16  # B's only source for MD's cache is what A wrote to Redis


def test_replicas_see_each_others_load(own_redis, worker_flags, start_router):
    one_md = (*worker_flags(mains=("md1",)), "--instance-capacity", "1", "--redis", own_redis.url,
              *PATIENT)  # fmt: skip
    c = start_router(*one_md, "--replica-id", "c")
    d = start_router(*one_md, "--replica-id", "d", *FROZEN)
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    r = redis.Redis.from_url(own_redis.url)
    with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=60) as held:
        lines = held.iter_lines()  # keep it: dropping it closes the stream
        next(lines)
        # MD counts the request in full from its first token (pending while it was at P),
        # and C writes its counts to Redis behind the request: D reads what C wrote.
        until_sync(lambda: int(r.hget("pdd:load:c", "md1") or 0) == 1, "C's count on md1")
        refused = httpx.post(f"{d.url}/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429, refused.text
    until_sync(
        lambda: (
            httpx.post(
                f"{d.url}/v1/completions", json={**body, "stream": False, "max_tokens": 1}
            ).status_code
            == 200
        ),
        "D still refuses after C's request ended",
    )


def test_killing_redis_mid_run_loses_no_request(replicas, own_redis):
    a, b = replicas
    messages = [{"role": "user", "content": "Count slowly from one to twenty."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{a.url}/v1/chat/completions", json=body, timeout=60) as inflight:
        lines = inflight.iter_lines()
        next(lines)
        own_redis.kill()
        for replica in (a, b, a, b):
            chat(replica, messages, max_tokens=8)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    assert 'finish_reason":"length"' in "".join(rest)
    own_redis.start()
    for replica in (a, b):
        until_sync(
            lambda replica=replica: (
                "pdd_router_redis_up 1.0" in httpx.get(f"{replica.url}/metrics").text
            ),
            "a replica did not reconnect to Redis",
        )
    r = redis.Redis.from_url(own_redis.url)
    assert r.keys("pdd:idx:i:*")  # the index was re-seeded from the replicas' local state
    chat(b, messages, max_tokens=4)


def gauge(router, name: str) -> float:
    """A gauge's value on the router's /metrics (which its event loop must be free to serve)."""
    text = httpx.get(f"{router.url}/metrics", timeout=60).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_hung_redis_stalls_no_request_and_is_reseeded_when_it_answers(
    own_redis, worker_flags, start_router
):
    """Redis stopped with SIGSTOP: it accepts connections and answers nothing. Replica W
    waits for it as long as it hangs (``--redis-deadline-s 600``): while one of W's
    requests is held on its Redis read, W goes on streaming another request's tokens and
    serving /metrics and /health. Replica L (the default deadline) serves every request
    from its local state, reports Redis down, and re-seeds it once it answers again."""
    w = start_router(*worker_flags(), "--redis", own_redis.url, "--replica-id", "w",
                     "--redis-deadline-s", "600")  # fmt: skip
    local = start_router(*worker_flags(), "--redis", own_redis.url, "--replica-id", "l")
    messages = [{"role": "user", "content": "Count slowly from one to twenty."}]
    chat(local, messages, max_tokens=4)
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with (
        httpx.stream("POST", f"{w.url}/v1/chat/completions", json=body, timeout=60) as streaming,
        ThreadPoolExecutor(1) as pool,
    ):
        lines = streaming.iter_lines()
        next(lines)
        own_redis.pause()
        try:
            held = pool.submit(chat, w, messages, 8)
            until_sync(
                lambda: gauge(w, "pdd_router_redis_reads_waiting") >= 1,
                "W's request waiting on the hung Redis",
            )
            assert httpx.get(f"{w.url}/health", timeout=60).status_code == 200
            rest = [line for line in lines if line]  # W's stream runs to its end meanwhile
            assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
            for _ in range(4):
                chat(local, messages, max_tokens=8)  # each one a 200 (chat asserts it)
                assert gauge(local, "pdd_router_redis_up") == 0
        finally:
            own_redis.resume()
        held.result()  # answered once Redis is back: a 200 too
    for replica in (w, local):
        until_sync(
            lambda replica=replica: gauge(replica, "pdd_router_redis_up") == 1,
            "a replica did not come back to Redis",
        )
    assert redis.Redis.from_url(own_redis.url).keys("pdd:idx:i:*")
    chat(local, messages, max_tokens=4)


def test_a_replica_killed_mid_stream_leaks_nothing_and_the_retry_serves(
    own_redis, worker_flags, start_router, cluster
):
    """The documented behaviour when a router replica dies: its client's stream breaks (no
    stream migrates between replicas), the workers end what it had started and hold
    nothing of it, and the client's retry on the other replica gets the whole answer."""
    a = start_router(*worker_flags(), "--redis", own_redis.url, "--replica-id", "dies")
    b = start_router(*worker_flags(), "--redis", own_redis.url, "--replica-id", "lives")
    messages = [{"role": "user", "content": "Count slowly from one to fifty, please."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with (
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", f"{a.url}/v1/chat/completions", json=body, timeout=60) as broken,
    ):
        lines = broken.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # tokens are flowing
        a.proc.kill()
        for _ in lines:  # the stream must end in an error, not hang and not finish
            pass
    states = cluster.wait_quiescent()  # nothing of the dead replica's request is held
    assert all(s.quiescent for s in states.values()), states
    retry = chat(b, messages, max_tokens=200)
    assert retry.json()["usage"]["completion_tokens"] == 200


@pytest.fixture
def second_redis(tmp_path):
    """Another redis-server, on its own port: the one that replaces ``own_redis``."""
    import shutil
    import subprocess

    from pdd.local.cluster import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd=tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    until_sync(lambda: _pings(url), "the second redis-server answering")
    yield url
    proc.kill()
    proc.wait(10)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.RedisError:
        return False


def test_a_second_redis_replacing_the_first_mid_replay_loses_no_request(
    own_redis, second_redis, worker_flags, start_router
):
    """Both replicas are given the two Redis URLs in order. The first dies while a
    conversation replays across them (a stream is in flight): every request is served,
    both replicas fail over to the second Redis and re-seed it from their local state,
    and what one replica learns the other then reads there."""
    urls = f"{own_redis.url},{second_redis}"
    a = start_router(*worker_flags(), "--redis", urls, "--replica-id", "a", *PATIENT)
    b = start_router(*worker_flags(), "--redis", urls, "--replica-id", "b", *FROZEN, *PATIENT)
    messages = [{"role": "user", "content": "Describe the harbour at dawn, boat by boat."}]
    first = chat(a, messages)
    md = route(first)["main"][0]
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{a.url}/v1/chat/completions", json=body, timeout=60) as inflight:
        lines = inflight.iter_lines()
        next(lines)
        own_redis.kill()
        for replica in (a, b, a, b):
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}
            ]  # fmt: skip
            first = chat(replica, messages, max_tokens=8)
            assert route(first)["main"][0] == md  # the conversation stays on its MD
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    assert 'finish_reason":"length"' in "".join(rest)
    r = redis.Redis.from_url(second_redis)
    until_sync(lambda: r.zcard("pdd:replicas:seen") == 2, "both replicas on the second Redis")
    for replica in (a, b):
        until_sync(
            lambda replica=replica: (
                "pdd_router_redis_up 1.0" in httpx.get(f"{replica.url}/metrics").text
            ),
            "a replica did not fail over to the second Redis",
        )
    assert r.keys("pdd:idx:i:*")  # re-seeded there from the replicas' local state
    # B polls no worker after its start: the next turn's hit on MD comes from the second
    # Redis, where A (or the re-seed) put it.
    answer = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    instance, hit = route(chat(b, messages, max_tokens=4))["main"]
    assert instance == md and hit >= 16
