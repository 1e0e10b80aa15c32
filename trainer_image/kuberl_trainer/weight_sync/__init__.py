"""Weight sync, trainer side: the sender (`sender`: the disaggregated group's rank 0 and the
update sequence), the colocated update across training ranks (`colocated`) and which training
rank feeds which engine TP rank (`routing`).

What both ends must agree on (request bodies, tensor payloads, dtype names, bucket planning,
the process group) is `kuberl_wire`, which the engine side imports too; the trainer never
imports the engine side (it talks to engines over HTTP only).
"""
