"""How reports are shown: Rich tables, HTML for notebooks, and heatmap pictures."""
