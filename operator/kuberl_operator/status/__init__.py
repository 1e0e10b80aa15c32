"""What an RLJob's status should be, and what to do about it: a pure function of what is observed.

`decide(body, observed, now)` takes the RLJob as the API server returned it (a raw dict: an
invalid spec must still get a status), the RayJobs it owns, the RayCluster of the current
attempt and the time, and returns a `Decision`: the operator-owned status fields, the actions
(create attempt N, delete a RayJob, delete the RLJob for its TTL) and the Events to post.
The reconciler executes the actions, posts the Events and writes the status in one patch.

Everything is level-triggered: the decision depends only on the RLJob (spec + its own status)
and the observed children, so an operator restarted at any point recomputes the same thing.
Timers live on the objects too: a condition's `lastTransitionTime`, KubeRay's own condition
times, `status.startTime`/`completionTime` and the trainer's `progress.lastHeartbeatTime`.

Attempts: attempt N runs as RayJob `names.rayjob(job, N)`. A restart (stall, lost head, failed
RayJob) creates N+1, deletes N and counts against `backoffLimit`; a resume after `suspend`
creates N+1 and does not count (suspending is the user's choice, not a failure; this matches
Kubernetes Jobs, where suspension never consumes the backoff). The restart count is also
stamped on each RayJob (annotation `kuberl.dev/restarts`), so a crash between creating the new
attempt and patching the status loses nothing. New attempts are created *before* the old one is
deleted: a crash in between leaves two RayJobs, and the next pass deletes the older one; the
reverse order could leave none and no record of why. An attempt whose trainer refused to start
(its checks before Ray found input that cannot run, reported as `status.trainerRefusal`) is not
restarted: the job fails at once (`refusal.py`).

Rejected alternative: reading and writing a separate attempt counter in the status. The status
schema is generated from kuberl_api (the operator may not add fields), and the attempt is
already recorded twice: in `status.rayJobName` and in the RayJob's `kuberl.dev/attempt` label.
"""

from kuberl_operator.status.builder import attempt_of, fmt_time, parse_time, section_digests
from kuberl_operator.status.decide import decide
from kuberl_operator.status.model import (
    ANNOTATION_RESTARTS,
    OWNED_KEYS,
    Action,
    CreateAttempt,
    Decision,
    DeleteEnvironment,
    DeleteRayJob,
    DeleteRLJob,
    Event,
    Observed,
    Tunables,
)
from kuberl_operator.status.pods import pod_problems

__all__ = [
    "ANNOTATION_RESTARTS", "OWNED_KEYS", "Action", "CreateAttempt", "Decision",
    "DeleteEnvironment", "DeleteRLJob", "DeleteRayJob", "Event", "Observed", "Tunables",
    "attempt_of", "decide", "fmt_time", "parse_time", "pod_problems", "section_digests",
]
