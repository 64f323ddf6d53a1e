// pgflow dashboard: refreshes each page's live part (an element with data-refresh) without a full reload.
(function () {
  "use strict";
  // A part the user is working in (a control of it has focus, or a choice was changed) is left alone until
  // the page changes: a refresh would undo the choice.
  document.querySelectorAll("[data-refresh]").forEach(function (el) {
    var every = parseInt(el.getAttribute("data-every"), 10) || 2000;
    var busy = false;
    var touched = false;
    el.addEventListener("change", function () { touched = true; });
    setInterval(function () {
      var active = document.activeElement;
      var editing = active && el.contains(active) && /^(SELECT|INPUT|TEXTAREA)$/.test(active.tagName);
      if (busy || document.hidden || touched || editing) return;
      busy = true;
      fetch(el.getAttribute("data-refresh"), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html !== null) {
            el.innerHTML = html;
            el.setAttribute("data-refreshed", String(Date.now()));
          }
        })
        .catch(function () {})
        .then(function () { busy = false; });
    }, every);
  });
})();
