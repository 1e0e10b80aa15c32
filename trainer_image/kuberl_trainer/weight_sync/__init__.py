"""Weight sync, trainer side: the process group both ends share (`group`), bucket planning
(`plan`), dtype names (`dtypes`), the tensor codec for the colocated path (`codec`), the
SGLang request bodies (`protocol`) and the sender (`sender`).

The engine side (kuberl_rollout) may import `group`, `plan`, `dtypes`, `codec` and `protocol`;
the trainer never imports the engine side (it talks to engines over HTTP only).
"""
