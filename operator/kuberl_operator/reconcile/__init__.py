"""The operator's side effects: kopf handlers (handlers.py), one reconcile pass per RLJob
(controller.py), adopt + create or server-side apply (children.py), observation (observe.py)
and the API client (kube.py). Every decision is made by the pure `kuberl_operator.status.decide`."""
