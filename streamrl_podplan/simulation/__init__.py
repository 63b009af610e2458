"""Pod-scale discrete-event simulator of the StreamRL pipeline (numpy only, no JAX).

Entry points: `simulator.simulate(scenario)`, `calibrate.run()`, `profiles.predict(path)`.
See docs/podplan.md.
"""
