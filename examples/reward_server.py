"""A reward service kuberl can call (reward.type remote; docs/rewards.md): exact match of the
response against the label. Copy it and replace `grade` with your own; run it with
`python reward_server.py` (port 8000) and point reward.url at http://<host>:8000/score.

kuberl POSTs {"items": [{"id", "prompt", "response", "label", "metadata"}]} and expects
{"rewards": [...]}, one number per item in the same order. An answer of HTTP 408, 429 or 5xx
is retried (with the same ids: cache by id if grading is costly); any other error fails the
job with this server's text, so answer 400 with a reason for a request you cannot grade.
"""

import json

from aiohttp import web


def grade(prompt: str, response: str, label: str, metadata: dict) -> float:
    return float(" ".join(response.split()).casefold() == " ".join(label.split()).casefold())


async def score(request: web.Request) -> web.Response:
    try:
        rewards = [grade(i["prompt"], i["response"], i["label"], i["metadata"])
                   for i in json.loads(await request.read())["items"]]
    except (KeyError, TypeError, ValueError) as exc:
        return web.Response(status=400, text=f"malformed request: {exc!r}")
    return web.json_response({"rewards": rewards})


def app() -> web.Application:
    application = web.Application(client_max_size=64 << 20)  # (a batch of long responses)
    application.router.add_post("/score", score)
    return application


if __name__ == "__main__":
    web.run_app(app(), port=8000)
