"""In-memory stand-ins for the services the core talks to: the store, Redis, the engine.

Each fake satisfies the same protocol as the real service (`genfleet.common.store.Store`,
`genfleet.common.redis_conn.RedisCommands`, the feeder's `ChatClient` and `EngineHandle`), and
the store and Redis fakes run through the same contract tests as the real services
(tests/common/test_store.py, tests/common/test_redis_contract.py), so a unit test on a fake
says something about the real thing.
"""
