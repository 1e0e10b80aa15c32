"""The contract between what the operator renders and what the trainer reads at run time.

Both sides import these from the API package (the operator and the trainer may not import each
other): the config file the head mounts, the environment every Ray pod gets, and the Ray custom
resources that pin actors to their group's pods.
"""

from __future__ import annotations

from typing import Final

# The job config inside the head: ConfigMap key and mount point; the RayJob entrypoint reads it.
CONFIG_KEY: Final = "rljob.yaml"
CONFIG_DIR: Final = "/etc/kuberl"
CONFIG_PATH: Final = f"{CONFIG_DIR}/{CONFIG_KEY}"

# The training loop's Prometheus endpoint on the head (step, reward, step-time split): the
# RayJob entrypoint passes it to `kuberl run --metrics-port`, the head container names it, and
# the Helm chart's PodMonitor scrapes it by that name.
TRAINER_METRICS_PORT: Final = 9100
TRAINER_METRICS_PORT_NAME: Final = "trainer-metrics"

# Identity of the running job, for the trainer's status reporter.
ENV_JOB_NAME: Final = "KUBERL_RLJOB_NAME"
ENV_JOB_NAMESPACE: Final = "KUBERL_RLJOB_NAMESPACE"
ENV_ATTEMPT: Final = "KUBERL_ATTEMPT"

# The engines' API key (kuberl_wire.protocol.ENGINE_API_KEY_ENV, the same name): every Ray
# pod reads it from the attempt's Secret (a secretKeyRef, so neither the pod spec, the
# ConfigMap nor a command line holds it), under this key of the Secret's data.
ENV_ENGINE_API_KEY: Final = "KUBERL_ENGINE_API_KEY"
ENGINE_API_KEY_SECRET_KEY: Final = "api-key"

# environment.image: the environment service's URL, which the operator sets on the head (its
# headless Service, whose name resolves to every ready replica) and `kuberl run` reads
# (--environment-url sets it too).
ENV_ENVIRONMENT_URL: Final = "KUBERL_ENVIRONMENT_URL"

# reward.auth: the reward service's credential, which the operator gives the head from the
# Secret the spec names (a secretKeyRef: neither the RLJob nor the ConfigMap holds it) and
# `kuberl run` reads from its environment.
ENV_REWARD_AUTH: Final = "KUBERL_REWARD_AUTH"

# Ray custom resources: a train actor asks for 1 unit of RESOURCE_TRAIN per GPU, an engine for
# gpusPerEngine units of RESOURCE_ROLLOUT (1 unit per actor on CPU). Colocated train pods carry
# both. A critic actor (PPO) asks for 1 unit of RESOURCE_CRITIC: dedicated critic pods carry one
# per GPU, and with a shared critic the train pods carry as many as RESOURCE_TRAIN.
RESOURCE_TRAIN: Final = "kuberl_train"
RESOURCE_ROLLOUT: Final = "kuberl_rollout"
RESOURCE_CRITIC: Final = "kuberl_critic"
# A served reward model's engine (reward.model) asks for gpusPerReplica units of RESOURCE_REWARD
# (1 on CPU): the reward pods carry one per GPU, or one on CPU.
RESOURCE_REWARD: Final = "kuberl_reward"

# Stopping gracefully (preemption, suspend, a node drain): the head's preStop hook runs
# `kuberl graceful-stop head`, which signals the training driver (its pid in DRIVER_PID_FILE) and
# waits while it saves a checkpoint; the train and critic pods' hook, `kuberl graceful-stop
# worker`, holds those pods (whose ranks write the checkpoint) until the driver's metrics port on
# the head closes. KubeRay stops no Ray job itself before it deletes a suspended RayJob's pods.
DRIVER_PID_FILE: Final = "/tmp/kuberl-driver.pid"
GRACEFUL_STOP: Final = ("kuberl", "graceful-stop")
# What the hooks leave of the grace period for Ray itself to stop after them.
GRACEFUL_STOP_MARGIN_SECONDS: Final = 10
