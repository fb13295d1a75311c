"""The project's own studies: each measures one question about kvloom (what serving costs, where a step's
time goes, how a feature compares) and regenerates one report under benchmarks/results/. `kvloom bench` is the
lab a user runs; these are how the project found out what is in docs/performance.md."""
