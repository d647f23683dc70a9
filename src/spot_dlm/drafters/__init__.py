"""Drafters propose trees of candidate next block states; verification keeps every one of them exact."""
