"""What the tests share: reference models and runs, assertions, fork-server and child-process modules.

tests/ is on sys.path (pytest puts the directory of the rootmost conftest.py there), so tests import these as
`from helpers.optim import ...`; child processes get tests/ on their path from the test that starts them."""
