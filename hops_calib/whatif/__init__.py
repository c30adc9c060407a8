"""What-if: a configuration before it runs. `job` prices a job directory under every schedule that can run it (each
hop by the hosts at its ends, `cluster`; under stragglers and failures, `perturbations`); `job_plan` searches a job's
launches (stage order, layer split, schedule, micro-batch size) on its devices; `plan` picks a schedule for abstract
balanced stages from simulations and closed forms."""
