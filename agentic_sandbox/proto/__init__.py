"""The agent-link contract: `agent.proto`'s generated code, and the names both sides use.

`LEADER_METADATA` is the trailing-metadata key of a follower's answer (several control hosts,
one leads): a follower refuses `Enroll`, `Renew` and `Connect` with `UNAVAILABLE` and names the
leader as `"<node> <agent-link address>"` under this key, so an agent dials the leader next.
"""

LEADER_METADATA = "sandbox-leader"
