"""Stand-ins for the services the core talks to: the store, Redis, the engine, the worker.

Each fake satisfies the same protocol as the real thing (`genfleet.common.store.Store`,
`genfleet.common.redis_conn.RedisCommands`, the feeder's `ChatClient` and `EngineHandle`, the
task's `TaskRuntime`), and the store and Redis fakes run through the same contract tests as the
real services (tests/common/test_store.py, tests/common/test_redis_contract.py), so a unit
test on a fake says something about the real thing. `http_engine.ScriptedEngine` is an engine
over real HTTP whose answers a test scripts, in the test's process or as an engine process.
"""
