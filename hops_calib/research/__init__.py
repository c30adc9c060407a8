"""Research: how a person or an agent finds the next change (observe where the error is, tune one term's parameters,
cross-validate whether they travel, the components of a stage's time, which parameters price which quantity);
computes, never prints."""
