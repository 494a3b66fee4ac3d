```python
def summarize_orders(data, min_total=0.0, currency="EUR"):
    totals = {}
    counts = {}
    for order in data:
        if order.get("status") != "paid":
            continue
        customer = order["customer"]
        amount = float(order["amount"])
        if order.get("currency", currency) != currency:
            amount = amount * order.get("rate", 1.0)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    rows = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        rows.append({
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "average": round(average, 2),
            "currency": currency,
        })
    rows.sort(key=lambda row: row["total"], reverse=True)
    if not data:
        return {"rows": [], "grand_total": 0.0}
    grand_total = sum(row["total"] for row in rows)
    return {"rows": rows, "grand_total": round(grand_total, 2)}
```
