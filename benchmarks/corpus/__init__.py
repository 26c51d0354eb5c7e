"""Third-party models, unedited (tests/real_models/): the corpus's results table."""
