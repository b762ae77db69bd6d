"""One module per strategy, each with its whole distribution concern: how its
processes are started and supervised, and what each process does."""
