"""Recipes: set-up -> train -> clean-up, top to bottom, each wiring the libraries for one command."""
