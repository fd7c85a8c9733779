"""Agent Lightning 1.0.2's server contract, route by route, with the real httpx client: status codes, payload
shapes and the error cases (401, 404, 409, 422, 204, 429, paging)."""

from __future__ import annotations

import httpx

from lightning_dagster.gateway import attempt_key
from lightning_dagster.types import AttemptState, Rollout
from tests.agl.conftest import KEY, SECRET, TRAIN_T, VAL_T

CHAT = {
    "model": "whatever-the-agent-names",
    "messages": [{"role": "user", "content": "hi"}],
    "temperature": 0.1,
}


def test_healthz_needs_no_key_and_every_other_route_answers_401_without_the_server_key(agl):
    assert httpx.get(f"{agl.url}/healthz").json() == {"status": "ok"}
    routes = [
        ("GET", "/api/rollouts?state_in=queuing"),
        ("POST", "/api/rollouts"),
        ("GET", "/api/rollouts/terminal"),
        ("GET", "/api/rollouts/r1"),
        ("PATCH", "/api/rollouts/r1"),
        ("DELETE", "/api/rollouts/r1"),
        ("POST", "/api/rollouts/r1/attempt/0/events"),
        ("GET", "/api/rollouts/r1/events"),
        ("POST", "/api/models"),
        ("DELETE", "/api/models"),
        ("POST", "/proxy/pause"),
        ("POST", "/proxy/resume"),
        ("GET", "/proxy/state"),
        ("POST", "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"),
    ]
    for method, path in routes:
        assert httpx.request(method, agl.url + path).status_code == 401, (method, path)
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.request(method, agl.url + path, headers=wrong).status_code == 401, (method, path)
    listed = httpx.get(f"{agl.url}/api/rollouts?state_in=queuing", headers={"x-api-key": KEY})
    assert listed.status_code == 200 and listed.json() == []


def test_create_returns_agent_lightning_rollouts_and_an_existing_id_returns_the_stored_one(agl):
    made = agl.create(
        {"input": {"q": 1, "data_id": "d1"}, "rollout_id": "r1", "metadata": {"batch_idx": 3, "extra": "x"}},
        {
            "input": "plain text",
            "is_train": False,
            "config": {"local": {"agent_class": "m:C", "env_map": {"Q": "input.q"}}},
        },
    )
    first, second = made
    assert first["rollout_id"] == "r1" and first["input"] == {"q": 1, "data_id": "d1"} and first["is_train"]
    assert first["config"] == {"timeout_seconds": 3600, "local": None, "k8s": None}
    assert first["metadata"] == {"batch_idx": 3, "sample_idx_in_batch": None, "extra": "x"}
    status = first["status"]
    assert status["state"] == "queuing" and status["version"] == 1 and status["last_attempt_id"] is None
    assert status["created_at"] == status["updated_at"]
    assert second["input"] == "plain text" and not second["is_train"] and len(second["rollout_id"]) == 32
    assert second["config"]["local"] == {"agent_class": "m:C", "env_map": {"Q": "input.q"}}
    again = agl.create({"input": {"changed": True}, "rollout_id": "r1"})
    assert again == [first]
    stored = agl.store.get_rollout("r1")
    assert stored.status.value == "queued" and stored.kind.value == "train" and stored.task_id == "d1"
    assert stored.metadata["sampling"]["temperature"] == TRAIN_T
    assert agl.store.get_rollout(second["rollout_id"]).metadata["sampling"]["temperature"] == VAL_T


def test_create_refuses_unknown_fields_and_bodies_that_are_not_lists_with_422(agl):
    assert agl.api.post("/api/rollouts", json=[{"input": 1, "colour": "red"}]).status_code == 422
    assert agl.api.post("/api/rollouts", json={"input": 1}).status_code == 422
    assert agl.api.post("/api/rollouts", json=[{"is_train": True}]).status_code == 422
    assert agl.api.post("/api/rollouts", content=b"[{").status_code == 400
    assert agl.api.post("/api/rollouts", json=[{"input": 1, "rollout_id": "x" * 65}]).status_code == 422
    slash = agl.api.post("/api/rollouts", json=[{"input": 1, "rollout_id": "a/b"}])  # never fetchable by id
    assert slash.status_code == 422 and slash.json()["error"]["param"] == "0.rollout_id"
    assert agl.api.get("/api/rollouts", params={"state_in": "queuing"}).json() == []


def test_an_id_held_by_a_rollout_of_another_surface_is_a_conflict(agl):
    agl.store.enqueue_rollouts([Rollout(rollout_id="ours")])
    assert agl.api.post("/api/rollouts", json=[{"input": 1, "rollout_id": "ours"}]).status_code == 409


def test_list_filters_by_state_honours_limit_and_shows_only_this_surfaces_rollouts(agl):
    agl.store.enqueue_rollouts([Rollout(rollout_id="runner-rollout")])
    agl.create(*({"input": i, "rollout_id": f"r{i}"} for i in range(4)))
    assert agl.patch("r1", state="running").status_code == 200
    queuing = agl.api.get("/api/rollouts", params={"state_in": "queuing"}).json()
    assert [r["rollout_id"] for r in queuing] == ["r0", "r2", "r3"]
    both = agl.api.get(
        "/api/rollouts", params=[("state_in", "queuing"), ("state_in", "running"), ("limit", 2)]
    )
    assert [r["rollout_id"] for r in both.json()] == ["r0", "r1"]
    assert agl.api.get("/api/rollouts").status_code == 422
    assert agl.api.get("/api/rollouts", params={"state_in": "queued"}).status_code == 422
    assert agl.api.get("/api/rollouts", params={"state_in": "running", "limit": "x"}).status_code == 422


def test_get_returns_the_rollout_with_its_real_attempts_and_404_when_missing(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.api.get("/api/rollouts/r1").json()["attempts"] == []
    agl.patch("r1", state="running", last_attempt_id="0")
    got = agl.api.get("/api/rollouts/r1").json()
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    assert got["attempts"] == ["0"] and attempt.state is AttemptState.running  # Agent Lightning's name
    assert (
        got["rollout"]["status"]["state"] == "running" and got["rollout"]["status"]["last_attempt_id"] == "0"
    )
    assert agl.api.get("/api/rollouts/missing").status_code == 404


def test_patch_moves_along_the_lifecycle_and_refuses_illegal_moves_with_409(agl):
    agl.create({"input": 1, "rollout_id": "r1"}, {"input": 2, "rollout_id": "r2"})
    running = agl.patch("r1", state="running", k8s_job_name="job-1").json()
    assert running["status"]["state"] == "running" and running["status"]["version"] == 2
    assert running["status"]["updated_at"] > running["status"]["created_at"]
    assert agl.patch("r1", state="running").status_code == 409
    assert agl.patch("r1", state="queuing").status_code == 409
    done = agl.patch("r1", state="succeeded").json()
    assert done["status"]["state"] == "succeeded" and done["status"]["k8s_job_name"] == "job-1"
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    assert attempt.state is AttemptState.succeeded and attempt.worker_id == "job-1"
    assert agl.patch("r1", state="failed").status_code == 409
    failed = agl.patch("r2", state="failed", error_message="spawn failed").json()
    assert failed["status"]["state"] == "failed" and failed["status"]["error_message"] == "spawn failed"
    assert agl.store.list_attempts(rollout_id="r2") == []
    assert agl.patch("r2", state="running").status_code == 409
    assert agl.patch("missing", state="running").status_code == 404


def test_patch_refuses_unknown_fields_and_states_with_422_and_an_empty_patch_changes_nothing(agl):
    (made,) = agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.patch("r1", colour="red").status_code == 422
    assert agl.api.patch("/api/rollouts/r1", json={"status": {}, "input": 2}).status_code == 422
    assert agl.patch("r1", state="done").status_code == 422
    assert agl.api.patch("/api/rollouts/r1", json={}).json() == made
    assert agl.api.get("/api/rollouts/r1").json()["rollout"]["status"]["version"] == 1


def test_terminal_pages_in_completion_order_and_a_deleted_rollout_keeps_its_position(agl):
    agl.create(
        *({"input": {"data_id": f"d{i}"}, "rollout_id": f"r{i}", "is_train": i != 1} for i in range(4))
    )
    for rid in ("r2", "r0", "r1"):
        agl.patch(rid, state="running")
    for rid, state in (("r2", "succeeded"), ("r0", "failed"), ("r1", "succeeded")):
        agl.patch(rid, state=state)
    page = agl.api.get("/api/rollouts/terminal", params={"limit": 2}).json()
    assert page == {
        "items": [
            {"rollout_id": "r2", "state": "succeeded", "data_id": "d2", "is_train": True},
            {"rollout_id": "r0", "state": "failed", "data_id": "d0", "is_train": True},
        ],
        "next_after": 2,
        "total_terminal": 3,
    }
    assert agl.api.delete("/api/rollouts/r0").status_code == 204
    rest = agl.api.get("/api/rollouts/terminal", params={"after": 1, "limit": 5}).json()
    assert [i["rollout_id"] for i in rest["items"]] == ["r1"] and rest["items"][0]["is_train"] is False
    assert rest["next_after"] == 3 and rest["total_terminal"] == 3
    tail = agl.api.get("/api/rollouts/terminal", params={"after": 3}).json()
    assert tail == {"items": [], "next_after": 3, "total_terminal": 3}
    assert agl.api.get("/api/rollouts/terminal", params={"after": "x"}).status_code == 422


def test_delete_is_204_also_for_a_missing_rollout_and_hides_it_from_every_route(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.api.delete("/api/rollouts/r1").status_code == 204
    assert agl.api.delete("/api/rollouts/r1").status_code == 204
    assert agl.api.delete("/api/rollouts/never").status_code == 204
    assert agl.api.get("/api/rollouts/r1").status_code == 404
    assert agl.api.get("/api/rollouts", params={"state_in": "queuing"}).json() == []
    assert agl.api.get("/api/rollouts/r1/events").status_code == 404
    assert agl.store.get_rollout("r1").rollout_id == "r1"  # kept in the store as lineage


def test_events_post_to_attempt_0_lands_on_the_current_attempt_in_agent_lightnings_shape(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running", last_attempt_id="0")
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    posted = agl.api.post(
        "/api/rollouts/r1/attempt/0/events", json={"event_type": "note", "data": {"k": "v"}}
    )
    assert posted.status_code == 200
    event = posted.json()
    assert event["event_type"] == "note" and event["data"] == {"k": "v"}
    assert event["rollout_id"] == "r1" and event["attempt_id"] == "0"
    assert isinstance(event["timestamp"], float)
    reward = {"event_type": "reward", "data": {"value": 0.5, "source": "agent", "message": "ok"}}
    assert agl.api.post("/api/rollouts/r1/attempt/0/events", json=reward).status_code == 200
    (stored,) = agl.store.list_rewards(rollout_id="r1")
    assert stored.value == 0.5 and stored.attempt_id == attempt.attempt_id
    events = agl.api.get("/api/rollouts/r1/events").json()
    assert [e["event_type"] for e in events] == ["note", "reward"]
    assert events[1]["data"] == {"value": 0.5, "source": "agent", "message": "ok"}
    triplet = agl.api.get("/api/rollouts/r1/events", params={"format": "triplet"}).json()
    assert triplet[1]["data"] == {"value": 0.5, "source": "agent"}
    only = agl.api.get("/api/rollouts/r1/events", params={"event_type": "reward"}).json()
    assert [e["event_type"] for e in only] == ["reward"]


def test_events_refuse_bad_input_and_unknown_rollouts_and_attempts(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")
    post = agl.api.post
    assert post("/api/rollouts/r1/attempt/0/events", json={"data": {}}).status_code == 422
    assert (
        post(
            "/api/rollouts/r1/attempt/0/events", json={"event_type": "reward", "data": {"value": "1"}}
        ).status_code
        == 422
    )
    assert post("/api/rollouts/nope/attempt/0/events", json={"event_type": "x"}).status_code == 404
    assert post("/api/rollouts/r1/attempt/at-unknown/events", json={"event_type": "x"}).status_code == 404
    assert agl.api.get("/api/rollouts/nope/events").status_code == 404
    assert agl.api.get("/api/rollouts/r1/events", params={"format": "csv"}).status_code == 422


def test_a_posted_model_request_with_token_ids_becomes_an_llm_span_and_a_deduplicated_triplet(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")
    choice = {"token_ids": [7, 8], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}
    data = {
        "model": "m",
        "http_status": 200,
        "status": "ok",
        "response": {"prompt_token_ids": [1, 2, 3], "choices": [choice]},
    }
    for _ in range(2):  # a retried request: the triplet keeps the last
        assert (
            agl.api.post(
                "/api/rollouts/r1/attempt/0/events", json={"event_type": "model_request", "data": data}
            ).status_code
            == 200
        )
    spans = agl.store.list_spans(rollout_id="r1", kind="llm")
    assert [(s.prompt_token_ids, s.response_token_ids, s.response_logprobs) for s in spans] == [
        ([1, 2, 3], [7, 8], [-0.5, -0.25])
    ] * 2
    triplet = agl.api.get("/api/rollouts/r1/events", params={"format": "triplet"}).json()
    assert len(triplet) == 1
    assert triplet[0]["data"]["prompt_token_ids"] == [1, 2, 3] and triplet[0]["data"][
        "response_token_ids"
    ] == [7, 8]
    assert (
        triplet[0]["data"]["response_log_probs"] == [-0.5, -0.25] and triplet[0]["data"]["http_status"] == 200
    )


def test_an_attempt_key_still_posts_to_the_event_url_as_the_gateways_own_route(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    key = attempt_key(SECRET, "r1", attempt.attempt_id)
    r = httpx.post(
        f"{agl.url}/api/rollouts/r1/attempt/{attempt.attempt_id}/events",
        json={"event_type": "reward", "data": {"value": 1.0}},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [w.value for w in agl.store.list_rewards(rollout_id="r1")] == [1.0]


def test_proxy_train_calls_sample_at_the_train_setting_with_logprobs_and_read_back_as_triplets(agl):
    agl.create({"input": 1, "rollout_id": "r1"})  # still queuing: the first call starts its attempt
    r = agl.api.post(agl.proxy("r1"), json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    (span,) = agl.store.list_spans(rollout_id="r1", kind="llm")
    assert span.attributes["temperature"] == TRAIN_T and span.attributes["requested"]["temperature"] == 0.1
    assert agl.api.get("/api/rollouts/r1").json()["rollout"]["status"]["state"] == "running"
    agl.api.post("/api/rollouts/r1/attempt/0/events", json={"event_type": "reward", "data": {"value": 1.0}})
    triplet = agl.api.get("/api/rollouts/r1/events", params={"format": "triplet"}).json()
    assert [e["event_type"] for e in triplet] == ["model_request", "reward"]
    data = triplet[0]["data"]
    assert (
        data["prompt_token_ids"] == span.prompt_token_ids
        and data["response_token_ids"] == span.response_token_ids
    )
    assert data["response_log_probs"] == span.response_logprobs and len(data["response_token_ids"]) == 8
    assert data["http_status"] == 200 and data["status"] == "ok"


def test_proxy_val_mode_applies_the_val_setting_and_a_mode_other_than_the_rollouts_is_409(agl):
    agl.create({"input": 1, "rollout_id": "v1", "is_train": False})
    assert agl.api.post(agl.proxy("v1", "train"), json=CHAT).status_code == 409
    r = agl.api.post(agl.proxy("v1", "val"), json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    (span,) = agl.store.list_spans(rollout_id="v1", kind="llm")
    assert span.attributes["temperature"] == VAL_T
    assert agl.api.post(agl.proxy("v1", "test"), json=CHAT).status_code == 404
    assert agl.api.post(agl.proxy("v1", "val", "embeddings"), json=CHAT).status_code == 404
    assert agl.api.post(agl.proxy("nope"), json=CHAT).status_code == 404


def test_proxy_serves_completions_and_streams(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    done = agl.api.post(agl.proxy("r1", path="completions"), json={"model": "x", "prompt": "abc"})
    assert done.status_code == 200 and done.json()["choices"][0]["logprobs"]["token_logprobs"]
    with agl.api.stream("POST", agl.proxy("r1"), json={**CHAT, "stream": True}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in streamed.read().decode()
    assert len(agl.store.list_spans(rollout_id="r1", kind="llm")) == 2


def test_a_finished_rollouts_proxy_calls_are_refused_with_409(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")
    agl.patch("r1", state="succeeded")
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 409


def test_pause_answers_429_with_retry_after_until_resume(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.api.get("/proxy/state").json() == {
        "paused": False,
        "retry_after_seconds": 5,
        "reason": None,
        "inflight": 0,
    }
    paused = agl.api.post("/proxy/pause", json={"reason": "weights", "retry_after_seconds": 2})
    assert paused.json() == {"paused": True, "retry_after_seconds": 2, "reason": "weights", "inflight": 0}
    refused = agl.api.post(agl.proxy("r1"), json=CHAT)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert refused.headers["x-agl-paused"] == "true" and refused.json()["reason"] == "weights"
    assert agl.api.post("/proxy/pause", json={"colour": 1}).status_code == 422
    resumed = agl.api.post("/proxy/resume").json()
    assert resumed == {"paused": False, "retry_after_seconds": 2, "reason": None, "inflight": 0}
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200


def test_registered_models_take_the_calls_and_an_upstream_4xx_is_recorded_with_its_status(agl, refusing):
    agl.create({"input": 1, "rollout_id": "r1"})
    entry = {"model": "served", "endpoint": f"{refusing.url}/v1", "version": 3}
    made = agl.api.post("/api/models", json=[entry])
    assert made.status_code == 201 and made.json() == [entry]
    assert agl.api.post("/api/models", json=[{"model": "m"}]).status_code == 422
    refused = agl.api.post(agl.proxy("r1"), json=CHAT)
    assert refused.status_code == 400
    (span,) = agl.store.list_spans(rollout_id="r1", kind="llm")
    assert span.status == "error" and span.attributes["http_status"] == 400
    (event,) = agl.api.get("/api/rollouts/r1/events", params={"format": "triplet"}).json()
    assert event["data"]["http_status"] == 400 and event["data"]["status"] == "error"
    assert agl.api.delete("/api/models").json() == {"status": "ok"}
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200


def test_a_rollout_sticks_to_one_of_several_registered_endpoints(agl, stub, refusing):
    endpoints = [{"model": "served", "endpoint": f"{s.url}/v1", "version": 0} for s in (stub, refusing)]
    agl.api.post("/api/models", json=endpoints)
    agl.create(*({"input": i, "rollout_id": f"r{i}"} for i in range(8)))
    outcomes = {}
    for i in range(8):
        first = agl.api.post(agl.proxy(f"r{i}"), json=CHAT).status_code
        again = agl.api.post(agl.proxy(f"r{i}"), json=CHAT).status_code
        assert first == again
        outcomes[f"r{i}"] = first
    assert set(outcomes.values()) == {200, 400}  # both endpoints serve some rollouts


def test_concurrent_creates_of_one_id_and_concurrent_moves_leave_one_rollout_and_one_attempt(agl):
    """Eight clients create the same rollout id at once (five ids in a row): every one gets the one stored
    rollout, 201. Then eight clients move each to running at once: one move starts the attempt, the others
    find it running (200) or are refused as an illegal move (409); never a second attempt or a 500."""
    from concurrent.futures import ThreadPoolExecutor

    def client() -> httpx.Client:
        return httpx.Client(base_url=agl.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    def create(rid: str, i: int) -> httpx.Response:
        with client() as c:
            return c.post("/api/rollouts", json=[{"input": {"i": i}, "rollout_id": rid}])

    def start(rid: str) -> httpx.Response:
        with client() as c:
            return c.patch(
                f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "0"}}
            )

    ids = [f"same-{k}" for k in range(5)]
    with ThreadPoolExecutor(8) as pool:
        for rid in ids:
            made = list(pool.map(create, [rid] * 8, range(8)))
            assert [r.status_code for r in made] == [201] * 8, [r.text for r in made if r.status_code != 201]
            assert len({str(r.json()[0]["input"]) for r in made}) == 1
        listed = agl.api.get("/api/rollouts", params={"state_in": "queuing", "limit": 50})
        assert sorted(r["rollout_id"] for r in listed.json()) == ids
        for rid in ids:
            moved = list(pool.map(start, [rid] * 8))
            assert {r.status_code for r in moved} <= {200, 409} and 200 in {r.status_code for r in moved}
            assert len(agl.store.list_attempts(rollout_id=rid)) == 1
            assert agl.api.get(f"/api/rollouts/{rid}").json()["rollout"]["status"]["state"] == "running"


def test_a_malformed_model_request_is_a_422_naming_its_field_and_writes_no_span(agl):
    """Token ids, logprobs and choices of a posted `model_request` become what the trainer reads: any of them
    malformed is refused, field named, and nothing is stored (never a 500)."""
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")

    def post(response: object, **extra: object) -> httpx.Response:
        event = {"event_type": "model_request", "data": {"response": response, **extra}}
        return agl.api.post("/api/rollouts/r1/attempt/0/events", json=event)

    ok = {"token_ids": [7, 8]}
    cases = {
        "data.response.choices": [{"prompt_token_ids": [1], "choices": "x"}, {"choices": [5]}],
        "data.response.prompt_token_ids": [{"prompt_token_ids": "abc", "choices": [ok]}],
        "data.response.choices.0.token_ids": [
            {"prompt_token_ids": [1], "choices": [{"token_ids": ["a"]}]},
            {"prompt_token_ids": [1], "choices": [{"token_ids": 7}]},
            {"prompt_token_ids": [1], "choices": [{"token_ids": [True]}]},
            {"prompt_token_ids": [1], "choices": [{"token_ids": [3, -1]}]},
        ],
        "data.response.choices.0.logprobs": [
            {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"content": [{"nolp": 1}] * 2}}]},
            {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"content": "zz"}}]},
            {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"content": [{"logprob": "x"}] * 2}}]},
            {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"token_logprobs": [1.0, 2.0, 3.0]}}]},
            {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"token_logprobs": "x"}}]},
        ],
    }
    for field, responses in cases.items():
        for response in responses:
            r = post(response)
            assert r.status_code == 422, (response, r.text)
            assert r.json()["error"]["message"].startswith(field), (field, r.text)
    r = post({"prompt_token_ids": [1], "choices": [ok]}, finish_reason=5)
    assert r.status_code == 422 and r.json()["error"]["param"] == "data.finish_reason"
    assert agl.store.list_spans(rollout_id="r1") == []
    good = {"prompt_token_ids": [1], "choices": [{**ok, "logprobs": {"token_logprobs": [-1, -0.5]}}]}
    assert post(good).status_code == 200
    (span,) = agl.store.list_spans(rollout_id="r1")
    assert span.response_token_ids == [7, 8] and span.response_logprobs == [-1.0, -0.5]


def test_numbers_out_of_range_are_refused_not_stored_as_something_else(agl):
    """A JSON number beyond a float (1e999) would be stored as null or Infinity; an integer query parameter
    beyond the database's integers would fail in the database: both are 422 naming the field."""
    r = agl.api.post("/api/rollouts", content=b'[{"input": {"a": [1, -2E+400]}, "rollout_id": "big"}]')
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("0.input.a.1: -inf")
    assert agl.api.get("/api/rollouts/big").status_code == 404
    made = agl.api.post(
        "/api/rollouts", content=b'[{"input": {"a": 1e308, "e123": "3e123"}, "rollout_id": "ok"}]'
    )
    assert made.status_code == 201 and agl.store.get_rollout("ok").task["input"] == {
        "a": 1e308,
        "e123": "3e123",
    }
    for path, param in [
        ("/api/rollouts?state_in=queuing&limit=99999999999999999999", "limit"),
        ("/api/rollouts/terminal?after=-99999999999999999999", "after"),
        ("/api/rollouts/terminal?limit=9223372036854775808", "limit"),
    ]:
        r = agl.api.get(path)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, (path, r.text)
    assert agl.api.get("/api/rollouts/terminal?limit=9223372036854775807").status_code == 200


def test_model_endpoints_must_be_http_urls_and_a_pause_is_bounded(agl):
    for endpoint in ["ftp://host/v1", "file:///etc/passwd", "http://", "not a url", "http://a,http://b", "x"]:
        r = agl.api.post("/api/models", json=[{"model": "m", "endpoint": endpoint}])
        assert r.status_code == 422 and r.json()["error"]["param"] == "0.endpoint", (endpoint, r.text)
    assert (
        agl.api.post("/api/models", json=[{"model": "m", "endpoint": "https://h:8443/v1"}]).status_code == 201
    )
    for body, param in [
        ({"retry_after_seconds": 10**30}, "retry_after_seconds"),
        ({"reason": "x" * 5000}, "reason"),
    ]:
        r = agl.api.post("/proxy/pause", json=body)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
    assert agl.api.get("/proxy/state").json()["paused"] is False
