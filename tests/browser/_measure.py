"""What the width tests measure in the browser (``test_widths_browser.py``: the ShardingExplorer;
``test_layout_advisor_widths_browser.py``: the LayoutAdvisor), in one place.

``MEASURE_JS`` takes ``{root, index, wrap, row}``: the widget (the ``index``-th match of the selector ``root``), its
table's scroll box (selector ``wrap``) and the class of a table row (a row may be followed by rows that belong to
it, e.g. its "why" line). It returns the texts clipped (reaching past the widget's edge, the window or a box that
hides or scrolls its overflow), the table cells narrower than their longest word (a run of text between spaces or
``<wbr>`` break points, measured with a Range) or than their whole text where it may not wrap, and how many rows
(each with the rows that belong to it) the scroll box shows at its top, of how many, in a box how tall.
"""

MEASURE_JS = """({root: selector, index, wrap: wrapSelector, row: rowClass}) => {
  const root = document.querySelectorAll(selector)[index || 0];
  const viewport = document.documentElement.clientWidth;
  const range = document.createRange();
  const where = (el) => {
    const named = el.closest('[class*="wb-"]');
    return named ? [...named.classList].filter((c) => c.startsWith('wb-')).join('.') : el.tagName.toLowerCase();
  };
  const shown = (el) => getComputedStyle(el).visibility !== 'hidden' && el.getClientRects().length > 0;
  const snippet = (text) => (text.length > 70 ? text.slice(0, 35) + ' … ' + text.slice(-30) : text);
  const rootBox = root.getBoundingClientRect();
  // the horizontal extent in which el's content can be seen: the widget, the window, every box that clips it
  const visibleSpan = (el) => {
    let left = Math.max(0, rootBox.left), right = Math.min(viewport, rootBox.right);
    for (let a = el; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX === 'visible') continue;
      const box = a.getBoundingClientRect();
      left = Math.max(left, box.left + a.clientLeft);
      right = Math.min(right, box.left + a.clientLeft + a.clientWidth);
    }
    return [left, right];
  };
  const textNodes = (el) => {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), nodes = [];
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const parent = n.parentElement;
      if (n.textContent.trim() && parent && !parent.closest('select, option, datalist, script, style')
          && shown(parent)) nodes.push(n);
    }
    return nodes;
  };

  const clipped = [];
  for (const node of textNodes(root)) {
    const [left, right] = visibleSpan(node.parentElement);
    range.selectNodeContents(node);
    const out = [...range.getClientRects()].find((r) => r.width > 0.5 && (r.right > right + 1 || r.left < left - 1));
    if (out) {
      const px = (a, b) => `${a.toFixed(0)}-${b.toFixed(0)} px`;
      clipped.push(`${where(node.parentElement)}: "${snippet(node.textContent.trim())}" spans `
                   + `${px(out.left, out.right)}, visible ${px(left, right)}`);
    }
  }
  for (const el of [root, ...root.querySelectorAll('*')]) {  // cut off inside its own box (an ellipsis, a label)
    if (!['hidden', 'clip'].includes(getComputedStyle(el).overflowX) || !shown(el)) continue;
    const own = [...el.childNodes].filter((n) => n.nodeType === Node.TEXT_NODE && n.textContent.trim());
    if (own.length && el.scrollWidth > el.clientWidth + 1) {
      clipped.push(`${where(el)}: "${snippet(el.textContent.trim())}" needs ${el.scrollWidth} px, `
                   + `has ${el.clientWidth}`);
    }
  }

  const width = (r) => [...r.getClientRects()].reduce((sum, rect) => sum + rect.width, 0);
  const nowrap = (el) => ['nowrap', 'pre'].includes(getComputedStyle(el).whiteSpace);
  const narrow = [];
  for (const cell of root.querySelectorAll('td, th')) {
    if (!shown(cell) || !cell.textContent.trim()) continue;
    const style = getComputedStyle(cell);
    const room = cell.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    let widest = 0, word = '';
    const consider = (w, text) => { if (w > widest) { widest = w; word = text; } };
    if (nowrap(cell)) {
      range.selectNodeContents(cell);
      consider(range.getBoundingClientRect().width, cell.textContent.trim());
    } else {
      for (const node of textNodes(cell)) {
        if (nowrap(node.parentElement)) {
          range.selectNodeContents(node);
          consider(width(range), node.textContent.trim());
          continue;
        }
        for (const m of node.textContent.matchAll(/\\S+/g)) {
          range.setStart(node, m.index);
          range.setEnd(node, m.index + m[0].length);
          consider(width(range), m[0]);
        }
      }
    }
    if (widest > room + 1) {
      const table = cell.closest('table');
      const head = table && table.rows[0] && table.rows[0].cells[cell.cellIndex];
      const column = head && head !== cell ? head.textContent.trim() : cell.textContent.trim();
      narrow.push(`${where(cell)}, column "${snippet(column)}": "${snippet(word)}" is ${widest.toFixed(0)} px, `
                  + `the column ${room.toFixed(0)} px`);
    }
  }

  const wrap = root.querySelector(wrapSelector);
  let rows = 0, visible = 0, box_height = null;
  if (wrap) {
    wrap.scrollTop = 0;
    const bottom = wrap.getBoundingClientRect().top + wrap.clientTop + wrap.clientHeight;
    const params = [...wrap.querySelectorAll(`tr.${rowClass}`)];
    rows = params.length;
    visible = params.filter((row) => {
      const next = row.nextElementSibling;
      const last = next && !next.classList.contains(rowClass) ? next : row;
      return last.getBoundingClientRect().bottom <= bottom + 1;
    }).length;
    box_height = wrap.clientHeight;
  }
  return {clipped, narrow, rows, visible, box_height, width: Math.round(rootBox.width),
          height: Math.round(rootBox.height)};
}"""


# Resolves after three animation frames in a row left the lab's and the boxes ``selector`` matches where they were.
SETTLE_JS = """async (selector) => {
  const boxes = () => JSON.stringify([document.querySelector('.jp-NotebookPanel'),
    ...document.querySelectorAll(selector)]
    .map((el) => el && el.getBoundingClientRect().toJSON()));
  let last = boxes(), same = 0;
  for (let frame = 0; frame < 600 && same < 3; frame++) {
    await new Promise((r) => requestAnimationFrame(r));
    const now = boxes();
    same = now === last ? same + 1 : 0;
    last = now;
  }
  return same >= 3;
}"""
