"""What tests share besides fixtures (conftest.py) and fakes (tests/fakes/): one module a noun,
each imported by name (`from harness.waits import wait_for`)."""
