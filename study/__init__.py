"""Research and benchmark code beside the runtime: run from a checkout of the repository (the tests and
`benchmarks/` import it from there), not installed with `dflash_jax` (pyproject's package list leaves it out) and
never imported by it (tests/test_layering.py checks the direction). It reads the library through its public names.

  rounds.py            record_rounds: the rounds of resident speculative decoding with what a route-ahead predictor
                       may read and the verify's exact routing; rounds_to_arrays / collect_route_data for fitting
  evaluate.py          score_predictor: any route-ahead predictor replayed offline on recorded rounds
  cost_model.py        round-time model of offloaded B0-B3 for real models and links (tables, estimates)
  needle.py            needle_set: needle-retrieval cases drawn from the training corpus's held-out split
  tree_calibration.py  calibration_samples / fit_calibration: the tree build's acceptance model, fitted offline
"""
