"""Research and benchmark code beside the runtime, never imported by it (a test checks the direction).

  rounds.py       record_rounds: the rounds of resident speculative decoding with what a route-ahead predictor
                  may read and the verify's exact routing; rounds_to_arrays / collect_route_data for fitting
  evaluate.py     score_predictor: any route-ahead predictor replayed offline on recorded rounds
  cost_model.py   round-time model of offloaded B0-B3 for real models and links (tables, estimates)

It may import anything in `dflash_jax`; `benchmarks/`, the tests and `train` build on it.
"""
