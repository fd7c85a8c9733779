"""Calc-X style arithmetic word problems solved with a calculator tool."""
