"""A fault-injecting OpenAI-compatible chat server that plays a scripted user (tests/test_user_faults.py,
scripts/bench_user_round.py).

It listens on 127.0.0.1 only (an ephemeral port), is started by whoever uses it, and stops itself on leaving
its `with` block or after `lifetime` seconds, whichever comes first.

The user it plays: POST /v1/chat/completions gets the simulator's chat (llm_users.user_sim_messages: the system
prompt with a task's instruction, the agent's greeting, then the conversation with roles flipped). The server
finds the task by that system prompt, rebuilds a users.ScriptedUser for it (seeded by the task id) and replays
the conversation through it from the start: the answer is what that scripted user says next. It keeps no
state between requests, so a retried or repeated request gets the same answer, and two runs get the same
conversations.

What it gets wrong, on purpose:
  latency, jitter   every answer waits latency + uniform(0, jitter) s (seeded)
  faults            {fault: probability}: each request draws at most one (seeded), among
                      "429"     Too Many Requests with Retry-After: retry_after (s)
                      "500", "503"   server errors
                      "drop"    the connection closed with no response at all
                      "garbage" a 200 whose body is not JSON
                      "empty"   a 200 chat completion whose message is empty
  script            faults for the first requests, in order of arrival ("ok" = none); `faults` after them
  restart(down_s)   down (requests in flight dropped, new connections refused), then up again on the same port
                    after down_s; down_s = inf: gone for good. restart_after=(n, down_s): when request n arrives.
What a user gets wrong, on purpose (tests/test_user_check.py): breaks {(task id, k): (reason, times)}, the k-th
message of that task's user (0: its opening) answered with BREAKS[reason], a message the check (llm_users.check_turn)
flags for that reason, its first `times` times (inf: always); then as the scripted user says it. A re-ask after the
check (llm_users.again_chat: the flagged message and a correction at the end of the chat) is answered as the request
without them. Such state is per conversation: give each task one trial.
Counters: requests (that reached it), outcomes (Counter of what each got: "broke REASON" for a break),
max_in_flight.
"""
import http.server
import json
import math
import random
import threading
import time
import zlib
from collections import Counter

import users
from envs import llm_users

FAULTS = ("429", "500", "503", "drop", "garbage", "empty")
BREAKS = {"early_stop": "Yes, please go ahead. ###STOP###",   # a yes and a stop together (τ²-bench issue 182)
          "wrong_fact": "My email is nobody@invented.example.", "agent_voice": "Hi! How can I help you today?",
          "empty": "..."}


def completion(text: str, prompt_chars: int) -> bytes:
    """A chat completion body saying text (usage: about 4 characters a token)."""
    p, c = prompt_chars // 4, max(len(text) // 4, 1)
    return json.dumps({"id": "fault-server", "object": "chat.completion", "created": 0, "model": "scripted",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}).encode()


def scripted_answer(task, chat: list[dict]) -> str:
    """What users.ScriptedUser (seeded by the task) says next in the simulator's chat: its opening for
    [system, greeting], else its reply, the conversation replayed through it from the start (its state, the
    writes confirmed and the replies made, comes back the same each time)."""
    user = users.ScriptedUser(task, seed=zlib.crc32(task.id.encode()))
    said, view = user.first_message(), []
    for m in chat[2:]:                          # the agent's view: roles flipped back
        view.append({"role": "user" if m["role"] == "assistant" else "assistant", "content": m["content"]})
        if view[-1]["role"] == "assistant":     # the agent spoke: the user answers
            said = user.reply(view)
    return said


class FaultServer:
    def __init__(self, tasks, latency=0.0, jitter=0.0, faults=None, script=(), retry_after=1.0, seed=0,
                 restart_after=None, lifetime=600.0, breaks=None):
        self.breaks, self.broken = dict(breaks or {}), Counter()   # (task id, k) -> (reason, times); times broken
        self.by_prompt = {llm_users.user_sim_messages(t, [])[0]["content"]: t for t in tasks}   # system prompt -> task
        self.latency, self.jitter, self.faults, self.script = latency, jitter, dict(faults or {}), list(script)
        self.retry_after, self.restart_after, self.rng = retry_after, restart_after, random.Random(seed)
        self.requests, self.outcomes, self.in_flight, self.max_in_flight = 0, Counter(), 0, 0
        self.lock, self.generation, self.closed, self.server = threading.Lock(), 0, False, None
        self.port = 0
        self._up()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.timer = threading.Timer(lifetime, self.close)   # bounded: it stops itself
        self.timer.daemon = True
        self.timer.start()

    # ---------------------------------------------------------------- up, down, restart
    def _up(self):
        with self.lock:
            if self.closed or self.server is not None:
                return
            self.server = _Server(("127.0.0.1", self.port), _handler(self))   # loopback only
            self.port = self.server.server_address[1]
            threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _down(self):
        with self.lock:
            server, self.server = self.server, None
            self.generation += 1                 # requests in flight see it and drop their connection
        if server is not None:
            server.shutdown()
            server.server_close()                # new connections are refused

    def restart(self, down_s: float):
        """Go down now; come back up after down_s seconds (never, for inf)."""
        self._down()
        if math.isfinite(down_s):
            t = threading.Timer(down_s, self._up)
            t.daemon = True
            t.start()

    def close(self):
        self.closed = True
        self._down()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        self.close()

    # ---------------------------------------------------------------- one request
    def _draw(self) -> tuple[str, float, int]:
        """This request's fault ("ok": none), its latency and the server's generation (under the lock)."""
        with self.lock:
            self.requests += 1
            n, gen = self.requests, self.generation
            if n <= len(self.script):
                fault = self.script[n - 1]
            else:
                x, fault = self.rng.random(), "ok"
                for name in FAULTS:                      # each fault owns a slice of [0, 1)
                    x -= self.faults.get(name, 0.0)
                    if x < 0:
                        fault = name
                        break
            wait = self.latency + self.rng.uniform(0, self.jitter)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.restart_after and n == self.restart_after[0]:
            threading.Thread(target=self.restart, args=(self.restart_after[1],), daemon=True).start()
        return fault, wait, gen

    def answer(self, body: dict) -> tuple[str, int, dict, bytes]:
        """-> (outcome, status, headers, body); outcome "drop": send nothing, close the connection."""
        fault, wait, gen = self._draw()
        try:
            time.sleep(wait)
            if self.generation != gen:                   # it went down while this request waited
                fault = "drop"
            chat = body.get("messages") or []
            if len(chat) > 2 and chat[-1]["role"] == "system":   # asked again after the check: without its additions
                chat = chat[:-2]
            task = self.by_prompt.get(chat[0].get("content") if chat else None)
            if fault == "ok" and task is None:
                return "unknown", 400, {}, b'{"error": {"message": "no task has this system prompt"}}'
            if fault == "ok" and (key := (task.id, sum(m["role"] == "assistant" for m in chat))) in self.breaks:
                reason, times = self.breaks[key]
                with self.lock:
                    broke, self.broken[key] = self.broken[key] < times, self.broken[key] + 1
                if broke:
                    return f"broke {reason}", 200, {}, completion(BREAKS[reason], len(json.dumps(chat)))
            if fault == "429":
                return fault, 429, {"Retry-After": str(self.retry_after)}, b'{"error": {"message": "slow down"}}'
            if fault in ("500", "503"):
                return fault, int(fault), {}, b'{"error": {"message": "server error"}}'
            if fault in ("drop", "garbage"):
                return fault, 200, {}, b"<html>502 Bad Gateway</html"
            size = len(json.dumps(chat))
            return fault, 200, {}, completion("" if fault == "empty" else scripted_answer(task, chat), size)
        finally:
            with self.lock:
                self.in_flight -= 1


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024   # the stdlib's backlog is 5: 256 users connecting at once would wait on SYN retries
    daemon_threads = True


def _handler(srv: FaultServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError:
                body = {}
            outcome, status, headers, payload = srv.answer(body)
            with srv.lock:
                srv.outcomes[outcome] += 1
            if outcome == "drop":                      # no status line, no body: the client sees the socket close
                self.close_connection = True
                return
            try:
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(payload)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass                                   # the client gave up (its timeout)

        def log_message(self, *args):
            pass
    return Handler
