"""An environment as its own service (environment.image, docs/agents.md).

`python -m kuberl_env module:Class` serves any class with the environment protocol of
`kuberl_trainer.agents` (async `reset(sample, **args)`, `step(action_ids, action_text)`,
`close()`; one instance per episode; a reset that declares `seed` gets the trajectory's)
over HTTP, so an environment runs in an image of its own,
with its own dependencies, beside the training job:

    POST /reset  {"episode", "sample", "args", "seed"}    -> {"observation": ... | null}
    POST /step   {"episode", "step", "action_ids", "action_text"} -> {"result": ...}
    POST /close  {"episode"}                               -> {"closed": true | false}
    GET  /health                                           -> {"status": "ok", ...}

The episode id is the client's, so every call can be retried: a reset of a known episode, or
the step of the index last run, answers what the first call answered (its result or its
error); a close of an episode that is gone answers `closed: false`. Errors come back as JSON,
`{"error", "call"}` with a message naming the episode: 422 when the environment's own code
failed, 404 for an unknown episode, 409 for a step out of order, 400 for a malformed request.
Episodes nobody touched for --episode-timeout seconds are closed and dropped.

The package needs only aiohttp (the environment image installs `kuberl[environment]`): no
torch, no Ray, no other kuberl package.
"""
