"""What every strategy's training process shares: runtime setup, recipe, run
files and the loop; and the Distribution that a strategy implements."""
