"""The rollout engines, as the trainer sees them: HTTP servers (SGLang, or the reference engine
on CPU) that it starts as Ray actors, talks to, watches, replaces and routes across.

- `command`: the engine's command line from the RLJob (SGLang's flags or the reference's)
- `actors`: EngineServer (one engine process in a Ray actor) and EngineGroup (all of them)
- `client`: EngineClient, the trainer's only way to speak to engines (generate, admin calls)
- `router`: SGLang's cache-aware router in front of the engines (rollout.router: sglang)
- `fleet`: replaces dead engines within the restart budget, mid-step
- `metrics`: the engines' own Prometheus metrics, served beside the trainer's

No torch here: the head imports this while Ray starts (startup.py).
"""
