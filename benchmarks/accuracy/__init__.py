"""Does a model still train to the same accuracy? The digits demo and the character GPT."""
