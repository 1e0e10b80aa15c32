"""A custom reward (imported by `module:function`, as users' rewards are) that a policy can
learn in a handful of steps, so integration tests can check that training moves the policy."""


def leading_one(response: str, label: str) -> float:
    return 1.0 if response.startswith("1") else 0.0
