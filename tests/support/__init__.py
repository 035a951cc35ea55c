"""What the tests share: clients, fakes, real processes, data builders and checks.

Fixtures stay in conftest.py files (tests/conftest.py holds the ones more than
one directory uses); the code they and the tests call lives here, one module
per kind of helper, so a test imports helpers from here and never from a
conftest.py or from another test module.
"""
