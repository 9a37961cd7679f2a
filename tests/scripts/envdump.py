"""Test worker: write this worker's environment (minus the parent's) as JSON to
$OUT_DIR/env.<RANK>.json."""

import json
import os

base = set(json.loads(os.environ.get("BASE_KEYS", "[]")))
env = {k: v for k, v in os.environ.items() if k not in base}
path = os.path.join(os.environ["OUT_DIR"], f"env.{os.environ['RANK']}.json")
with open(path, "w") as f:
    json.dump(env, f, sort_keys=True)
