"""Property-based fuzzing of every route of the router, over real HTTP to a router in front of
emulated workers: the cases (`strategies`), sending them and checking each answer
(`harness`), and the long run (`python -m bench.fuzz --cases 10000`). The suite's bounded run
is `tests/fuzz/test_router_fuzz.py`."""
