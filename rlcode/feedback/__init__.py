"""Learning from people: preference data, reward models trained on choices, simulated users.

* `preferences`: the pairwise preference format (JSON lines) and its reader, writer and split.
* `reward_model`: the Bradley-Terry loss, a reward model (the policy architecture with its scalar
  value head read at the last token), its training, evaluation (pairwise accuracy, calibration)
  and a batched scoring API usable as a reward.
* `simulated_users`: preferences drawn from a hidden ground truth with label noise and a
  systematic bias, and candidate completions of the synthesis tasks to label, for experiments
  that need no people.
* `monitor`: over-optimisation of a learned reward, caught online from a gold-labelled audit sample.
* `behaviour`: shifts of a policy's behaviour (answering, asking clarifying questions, malformed
  calls, length) against the start of its run, in both RL jobs.
* `usage_log`: the append-only log of served interactions and their outcome events (robust to
  torn, duplicated and out-of-order records), read by the real-time job (`rlcode.train.usage`).
* `registry`: which published checkpoint is live. `deployment`: a simulated deployment that serves
  it to users with hidden preferences and writes the usage log. `ab`: A/B comparisons of releases
  with Wilson / Newcombe intervals.
"""
