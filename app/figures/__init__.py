"""Pure figure builders: records and reports in, plotly figures out (no streamlit, no engine, no torch).

style: the shared palette and labels; path, alignment, symmetry: the figures of each page.
"""
