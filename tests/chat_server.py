"""A fake OpenAI-compatible chat server for the user-simulator tests (tests/test_users.py, tests/test_tau2.py)."""
import http.server
import json
import threading
import time


def completion(text="Yes, please cancel it.", prompt_tokens=50, completion_tokens=7, message=None):
    """A chat completion body: the assistant says text (or, given message, that message: content, tool_calls)."""
    return json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", **(message or {"content": text})}}],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}}).encode()


class FakeServer:
    """A real HTTP server on 127.0.0.1 (ephemeral port) that answers request i with script[i]
    (the last entry repeats): "ok", "slow" (sleeps 1 s, then ok), "500", "429", "401",
    "garbage" (200, body not JSON) or "nochoices" (200, JSON that is not a chat completion);
    an entry may also be a message dict (200, that message: {"content": ..., "tool_calls": [...]}) or a
    function of the request body that returns one of those.
    max_in_flight: the most requests it was answering at once; last_answer: when it answered the last one."""

    def __init__(self, *script):
        self.script, self.requests = list(script), []
        self.in_flight = self.max_in_flight = 0
        lock, outer = threading.Lock(), self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization"),
                                           "t": time.time()})
                    what = outer.script[min(len(outer.requests), len(outer.script)) - 1]
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    self.answer(what(body) if callable(what) else what)
                finally:
                    with lock:
                        outer.in_flight -= 1
                        outer.last_answer = time.time()

            def answer(self, what):
                if what == "slow":
                    time.sleep(1.0)
                status, payload = (200, completion(message=what)) if isinstance(what, dict) else {"ok": (200, completion()), "slow": (200, completion()),
                                   "500": (500, b'{"error": {"message": "boom"}}'),
                                   "429": (429, b'{"error": {"message": "slow down"}}'),
                                   "401": (401, b'{"error": {"message": "bad key"}}'),
                                   "garbage": (200, b"<html>502 Bad Gateway</html"),
                                   "nochoices": (200, b'{"hello": "world"}')}[what]
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            # the stdlib's listen backlog is 5: a 6th connection at once waits for the client's 1-s SYN
            # retry, which reads as a user pool that did not ask all at once
            request_queue_size = 128

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
