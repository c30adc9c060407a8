"""What-if: a configuration before it runs (predict --job prices a job directory under every schedule that can run it;
plan balances stages and picks microbatches from closed forms)."""
